"""A pure model of one SGLang replica's scheduler: prefill-first batching, admission against a reserved token
budget, retraction, a longest-prefix-match waiting queue and a token-granular radix cache.

The same interface as ``bench.emulator.model.EngineModel`` (submit, cancel, start_step / complete_step /
next_step, the state properties and counters, Step / TokenOutput / FinishedRequest), so the live emulator and the
simulator drive either; ``bench.emulator.model.make_engine`` picks this one for ``EngineParams(admission="sglang")``.
No clock reads: time is an argument. Tokens are words, as in ``bench.emulator.model``.

Source: sgl-project/sglang **v0.4.3** (the wheel on PyPI), python/sglang/srt unless noted. Each rule:

1. Steps (``managers/scheduler.py``: ``Scheduler.get_next_batch_to_run``). A step is either a *prefill* (extend)
   batch or one *decode* step of the whole running batch, never both (``enable_mixed_chunk`` is off by default):
   a prefill batch runs whenever one can be formed (``get_new_batch_prefill``), else the running batch decodes
   (``update_running_batch``). A prefill step samples each completed request's next token (the first one for a
   new request); a decode step samples one token per running request.
2. Waiting queue (``managers/schedule_policy.py``: ``SchedulePolicy.calc_priority``,
   ``_determine_active_policy``, ``_sort_by_longest_prefix``). Arrivals and retracted requests join the tail. Before
   each admission pass with policy "lpm" and at most ``lpm_fcfs_threshold`` (128) waiting, every waiting request
   is matched against the radix cache (its known tokens less the last, ``Req.adjust_max_prefix_ids``) and the
   queue is stably sorted by matched length, longest first; with more waiting the queue is left in its order
   (FCFS). Not modelled: the in-batch prefix deprioritisation (``IN_BATCH_PREFIX_CACHING_*``).
3. Admission (``PrefillAdder``). ``rem_total_tokens`` = free tokens + evictable cache tokens - offset, where the
   offset starts at ``sum(min(max_new_tokens - generated, clip) x new_token_ratio)`` over the running batch and
   grows by each admitted request's ``extend_input_len + min(max_new_tokens, clip)`` (``_prefill_one_req``;
   ``max_new_tokens`` is the request's ``max_tokens``). ``add_one_req``: refuse (NO_TOKEN, and the batch counts as
   full) when that total is >= ``rem_total_tokens``, and again after locking the request's cached prefix (the
   lock takes it out of the evictable tokens); stop (OTHER) when its input exceeds the ``max_prefill_tokens`` left
   and something is admitted already. An input longer than the ``chunked_prefill_size`` left is cut to it (one
   chunked request at a time, which continues first in the next prefill batches, ``add_chunked_req``). After each
   request ``budget_state`` stops the pass when no token, prefill or chunk budget is left. The pass also stops at
   ``max_running_requests``. Once a pass stops for lack of tokens or slots, no prefill is tried until the running
   batch shrinks (``batch_is_full``).
4. ``new_token_ratio`` (``Scheduler.__init__``, ``update_running_batch``, ``event_loop_normal``;
   ``global_config.py``): starts at ``init_new_token_ratio`` (0.7), falls by ``(init - init x factor) /
   decay_steps`` after every decode step that had memory, to ``init x factor`` (0.098); after a retraction it is
   set to ``min(1, (decoded tokens + retract_decode_steps x batch) / sum(max_new_tokens))`` over the requests
   kept; an idle scheduler resets it to the initial value.
5. Decode memory and retraction (``managers/schedule_batch.py``: ``ScheduleBatch.check_decode_mem``,
   ``retract_decode``; ``Req.reset_for_retract``). A decode step needs one free token per running request; it
   evicts cache to get them, and when still short retracts: requests sorted by (output tokens, -input tokens)
   descending, victims taken from the end (fewest output tokens first, ties: longest input, then the latest in
   the batch), at least one, until ``retract_decode_steps`` tokens per remaining request are free or one is left.
   A victim frees its uncached KV (its prompt stays in the radix cache, unlocked), keeps its output and joins the
   waiting queue's tail; readmitted, it recomputes prompt and output less the cached prefix. Counted in
   ``retractions`` (``num_preemptions`` is the same number, the interface name the emulator's metrics read).
6. Radix cache (``mem_cache/radix_cache.py``; :mod:`bench.emulator.radix_cache`). After a prefill step each
   request's computed tokens are inserted and locked (``cache_unfinished_req``: duplicates of tokens already
   cached are freed); a finished request's prompt plus output (less the last token) is inserted and unlocked
   (``cache_finished_req``). Generated tokens are keyed per request (ints unique to it), so they never match
   another prompt, as the vLLM model assumes. Allocation evicts unlocked leaves, least recently used first.

Counters: ``prefix_cache_queries`` / ``prefix_cache_hits`` count prompt tokens and matched ones at a request's
first admission, as the vLLM model does, so hit rates compare (SGLang's own ``cache_hit_rate`` counts every
prefill batch, retracted recomputation included). ``kv_usage`` is SGLang's ``token_usage``: tokens neither free
nor evictable over the capacity. Step time uses ``EngineParams.step_seconds`` unchanged (a prefill step has no
decoding sequences), so speeds stay calibrated. Not modelled: the overlap scheduler (results processed one
step later), jump-forward decoding, a finished request staying in the batch until the next decode step filters it.
"""

from __future__ import annotations

import hashlib

from bench.emulator.model import (
    EngineParams,
    FinishedRequest,
    RequestTooLong,
    output_length,
    Step,
    TokenOutput,
)
from bench.emulator.radix_cache import RadixCache, TreeNode

__all__ = ["SglangEngineModel", "sglang_max_running_requests"]

_new_tuple = tuple.__new__
#: Generated tokens are ints unique to their request: request serial x this + index (prompts are words).
_OUT_STRIDE = 1 << 32
_NO_TOKEN, _OTHER, _CONTINUE = 0, 1, 2


def sglang_max_running_requests(kv_tokens: int, context_len: int = 131072) -> int:
    """SGLang's default running-request limit (``managers/tp_worker.py`` ``TpModelWorker.__init__``:
    ``min(max_total_num_tokens // 2, req_to_token_pool.size)``; the pool holds ``min(max(int(kv_tokens /
    context_len x 512), 2048), 4096) + 1`` requests, ``model_runner.py`` ``init_memory_pool``; Llama-3.1's
    ``context_len`` is 131072)."""
    pool = min(max(int(kv_tokens / context_len * 512), 2048), 4096) + 1
    return min(kv_tokens // 2, pool)


class _Req:
    """Mutable per-request state (internal). ``prefix_len``: tokens of it the cache holds under ``last_node``'s lock
    (or, while waiting, the last match); ``private``: KV tokens it holds outside the cache."""

    __slots__ = ("request_id", "tokens", "prompt_len", "max_tokens", "output_len", "finish_reason", "seed",
                 "out_base", "submitted_at", "admitted_at", "first_token_at", "cached_tokens", "num_generated",
                 "prefix_len", "last_node", "locked", "private", "extend", "retractions")

    def __init__(self, request_id: str, tokens: list[str], max_tokens: int, output_len: int, finish_reason: str,
                 seed: int, serial: int, now: float):
        self.request_id = request_id
        self.tokens = tokens
        self.prompt_len = len(tokens)
        self.max_tokens = max_tokens
        self.output_len = output_len
        self.finish_reason = finish_reason
        self.seed = seed
        self.out_base = serial * _OUT_STRIDE
        self.submitted_at = now
        self.admitted_at: float | None = None
        self.first_token_at = now
        self.cached_tokens = 0
        self.num_generated = 0
        self.prefix_len = 0
        self.last_node: TreeNode | None = None
        self.locked = False  # whether it holds a lock on last_node
        self.private = 0
        self.extend = 0  # tokens the in-flight prefill step computes for it
        self.retractions = 0

    def fill(self, n: int) -> list:
        """Its first ``n`` known tokens: prompt words, then its generated tokens' keys."""
        if n <= self.prompt_len:
            return self.tokens[:n]
        base = self.out_base
        return self.tokens + list(range(base, base + n - self.prompt_len))


class SglangEngineModel:
    """One SGLang replica's scheduler state (module docstring). Not thread-safe; deterministic for a given sequence
    of calls. Drive it as ``EngineModel``: ``submit`` / ``cancel``, then ``start_step(now)`` and
    ``complete_step(step)`` at ``step.end`` (or ``next_step``)."""

    def __init__(self, params: EngineParams | None = None):
        self.params = params = params or EngineParams(admission="sglang")
        self.capacity = params.kv_cache_tokens
        self.max_running = (params.max_running_requests if params.max_running_requests is not None
                            else sglang_max_running_requests(self.capacity))
        self.init_ratio = min(params.init_new_token_ratio, 1.0)
        self.min_ratio = min(self.init_ratio * params.min_new_token_ratio_factor, 1.0)
        self.ratio_decay = (self.init_ratio - self.min_ratio) / params.new_token_ratio_decay_steps
        #: SGLang's ``new_token_ratio``: the share of the running requests' remaining output admission reserves.
        self.new_token_ratio = self.init_ratio
        self.cache = RadixCache()
        self.available = self.capacity  # free KV tokens (neither cached nor held by a request)
        self._waiting: list[_Req] = []
        self._running: dict[str, _Req] = {}  # the decode batch, in the order requests joined it
        self._chunked: _Req | None = None  # the request whose prompt is being prefilled in chunks
        self._ids: dict[str, _Req] = {}  # every waiting or running request
        self._full = False  # SGLang's batch_is_full: no prefill pass until the batch shrinks
        self._shrunk = False  # a request left the batch since the last decode step
        self._serial = 0
        self._in_flight: tuple[Step, list[_Req], list[_Req]] | None = None  # step, prefilled, finished
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.requests_finished: dict[str, int] = {"stop": 0, "length": 0, "abort": 0}
        #: Running requests retracted because a decode step ran out of KV (SGLang logs "Decode out of memory").
        self.retractions = 0

    # ---- state ----------------------------------------------------------------------------------------------

    @property
    def num_preemptions(self) -> int:
        """``retractions`` under the name the emulator's metrics and the vLLM model use."""
        return self.retractions

    @property
    def num_waiting(self) -> int:
        """Requests in the waiting queue (SGLang ``num_queue_reqs``): not admitted yet, or retracted."""
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        """Requests admitted: the decode batch plus a request being prefilled in chunks."""
        return len(self._running) + (self._chunked is not None)

    @property
    def num_free_blocks(self) -> int:
        """Tokens free or evictable (page size 1: a block is one token)."""
        return self.available + self.cache.evictable_size

    @property
    def kv_usage(self) -> float:
        """SGLang ``token_usage``: tokens neither free nor evictable, over the capacity (0-1)."""
        return 1.0 - (self.available + self.cache.evictable_size) / self.capacity

    def cached_prefix_tokens(self, prompt_tokens: list[str]) -> int:
        """Tokens of this prompt the radix cache holds now (at most all but the last); no side effects."""
        return self.cache.peek_prefix(prompt_tokens[: max(len(prompt_tokens) - 1, 0)])

    def has_request(self, request_id: str) -> bool:
        """Whether the request is waiting or running."""
        return request_id in self._ids

    # ---- requests -------------------------------------------------------------------------------------------

    def submit(self, request_id: str, prompt_tokens: list[str], max_tokens: int | None, *, ignore_eos: bool,
               now: float, output_len: int | None = None) -> None:
        """Queue a request at the tail of the waiting queue (same contract as ``EngineModel.submit``, ``output_len``
        included: SGLang reserves KV by ``max_tokens`` while the reply ends at its own length).

        Raises ValueError for a duplicate id, an empty prompt or ``max_tokens`` < 1, and RequestTooLong when
        ``len(prompt_tokens) + max_tokens`` exceeds ``params.model_len`` (SGLang's ``max_req_len``).
        """
        if request_id in self._ids:
            raise ValueError(f"request {request_id!r} is already in the engine")
        prompt_len = len(prompt_tokens)
        if prompt_len == 0:
            raise ValueError("the prompt is empty")
        model_len = self.params.model_len
        if max_tokens is None:
            max_tokens = model_len - prompt_len
            if max_tokens < 1:
                raise RequestTooLong(f"The input ({prompt_len} tokens) is longer than the model's context length "
                                     f"({model_len} tokens).")
        elif max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        elif prompt_len + max_tokens > model_len:
            raise RequestTooLong(f"Requested token count exceeds the model's maximum context length of {model_len} "
                                 f"tokens. You requested a total of {prompt_len + max_tokens} tokens: {prompt_len} "
                                 f"tokens from the input messages and {max_tokens} tokens for the completion.")
        seed = int.from_bytes(hashlib.blake2b("\x1f".join(prompt_tokens).encode(), digest_size=8).digest(), "big")
        output_len, reason = output_length(seed, max_tokens, ignore_eos=ignore_eos, output_len=output_len,
                                           eos_max_tokens=self.params.eos_max_tokens)
        self._serial += 1
        req = _Req(request_id, list(prompt_tokens), max_tokens, output_len, reason, seed, self._serial, now)
        self._ids[request_id] = req
        self._waiting.append(req)

    def cancel(self, request_id: str, *, now: float) -> bool:
        """Drop a waiting or running request and free its KV; False when unknown (finished or cancelled)."""
        req = self._ids.pop(request_id, None)
        if req is None:
            return False
        if self._running.pop(request_id, None) is not None or self._chunked is req:
            if self._chunked is req:
                self._chunked = None
            self._free(req)
            self._shrunk = True
        else:
            self._waiting.remove(req)
        self.requests_finished["abort"] += 1
        return True

    # ---- iterations -----------------------------------------------------------------------------------------

    def start_step(self, now: float) -> Step | None:
        """Plan the next iteration at ``now`` (s): a prefill batch if one can be formed, else a decode step (module
        docstring, rule 1); None when nothing is waiting or running. Call ``complete_step`` at the step's end."""
        if self._in_flight is not None:
            raise RuntimeError("a step is already in flight: call complete_step first")
        for _ in range(2):  # a second pass only after an idle scheduler iteration (no running batch)
            batch = self._prefill_batch(now)
            if batch:
                return self._plan_prefill(now, batch)
            if self._shrunk:  # update_running_batch: a smaller batch may let a prefill in again
                self._full = self._shrunk = False
            if self._running:
                return self._plan_decode(now)
            self.new_token_ratio = self.init_ratio  # idle: SGLang re-inits the ratio
            self._full = False
            if not self._waiting:
                return None
        raise RuntimeError("internal error: requests wait but none can be admitted into an empty engine")

    def complete_step(self, step: Step) -> None:
        """End the in-flight ``step``: cache what its prefills computed and release finished requests."""
        if self._in_flight is None or self._in_flight[0] is not step:
            raise RuntimeError("complete_step needs the step returned by the last start_step")
        _, prefilled, done = self._in_flight
        self._in_flight = None
        ids = self._ids
        for r in prefilled:
            if ids.get(r.request_id) is r:  # skip cancelled ones
                self._cache_unfinished(r)
        for r in done:
            if ids.get(r.request_id) is r:
                del ids[r.request_id]
                del self._running[r.request_id]
                self._cache_finished(r)
                self._shrunk = True
                self.requests_finished[r.finish_reason] += 1

    def next_step(self, now: float) -> Step | None:
        """``start_step`` and ``complete_step`` at once."""
        step = self.start_step(now)
        if step is not None:
            self.complete_step(step)
        return step

    # ---- prefill ----------------------------------------------------------------------------------------------

    def _prefill_batch(self, now: float) -> list[_Req]:
        """SGLang ``get_new_batch_prefill`` with ``PrefillAdder`` (rules 2-3): the requests of the next prefill
        batch, each with ``extend`` set; admitted ones are out of the waiting queue and locked in the cache."""
        chunked = self._chunked
        if (self._full or not self._waiting) and chunked is None:
            return []
        running_bs = len(self._running)
        if running_bs >= self.max_running:
            self._full = True
            return []
        prefix_computed = self._calc_priority()
        p = self.params
        clip = p.clip_max_new_tokens
        ratio = self.new_token_ratio
        # [total offset, current offset, prefill tokens left, chunk tokens left] (PrefillAdder's fields)
        budget = [sum(min(r.max_tokens - r.num_generated, clip) for r in self._running.values()) * ratio, 0,
                  p.max_prefill_tokens, p.chunked_prefill_size]
        can_run: list[_Req] = []
        if chunked is not None:
            if not self._add_chunked(chunked, budget):
                self._chunked = None  # its last chunk: it joins the batch after this step
            can_run.append(chunked)
        new_chunked = None
        for req in self._waiting:
            if running_bs + len(can_run) >= self.max_running:
                self._full = True
                break
            if not prefix_computed:
                self._match(req)
            res = self._add_one(req, budget, can_run)
            if res == _NO_TOKEN:
                self._full = True
            if res != _CONTINUE:
                break
        last = can_run[-1] if can_run else None
        if last is not None and last is not chunked and last.extend < last.prompt_len + last.num_generated - \
                last.prefix_len:
            new_chunked = last  # cut to the chunk budget: only the last admitted can be
        if not can_run:
            return []
        admitted = set(map(id, can_run))
        self._waiting = [r for r in self._waiting if id(r) not in admitted]
        if new_chunked is not None:
            self._chunked = new_chunked
        for r in can_run:
            self._admit(r, now, r is self._chunked)
        return can_run

    def _calc_priority(self) -> bool:
        """SGLang ``SchedulePolicy.calc_priority``: LPM sort when short enough; True when prefixes were matched."""
        p = self.params
        waiting = self._waiting
        if p.schedule_policy != "lpm" or len(waiting) > p.lpm_fcfs_threshold:
            return False
        for r in waiting:
            self._match(r)
        waiting.sort(key=lambda r: -r.prefix_len)  # stable: equal matches keep their order
        return True

    def _match(self, req: _Req) -> None:
        """Match the request's known tokens less the last against the cache (``init_next_round_input``)."""
        n = req.prompt_len + req.num_generated - 1
        req.prefix_len, req.last_node = self.cache.match_prefix(req.fill(n))

    def _rem_total(self, budget: list) -> float:
        return self.available + self.cache.evictable_size - budget[0]

    def _add_one(self, req: _Req, budget: list, can_run: list[_Req]) -> int:
        """SGLang ``PrefillAdder.add_one_req`` (tree cache on): admit ``req`` whole or its first chunk, or refuse;
        returns NO_TOKEN, OTHER or CONTINUE (``budget_state``)."""
        clip = self.params.clip_max_new_tokens
        extend = req.prompt_len + req.num_generated - req.prefix_len
        total = extend + min(req.max_tokens, clip)
        req.extend = 0
        if total >= self._rem_total(budget):
            return _NO_TOKEN
        if extend > budget[2] and can_run:
            return _OTHER
        self.cache.inc_lock_ref(req.last_node)  # the lock itself shrinks the evictable tokens
        if total > self._rem_total(budget):
            self.cache.dec_lock_ref(req.last_node)
            return _NO_TOKEN
        if extend <= budget[3]:
            budget[0] += total
        else:
            if budget[3] == 0:
                self.cache.dec_lock_ref(req.last_node)
                return _OTHER
            extend = budget[3]  # its first chunk; nothing reserved for its output yet
            budget[0] += extend
        req.locked = True
        req.extend = extend
        budget[1] += extend
        budget[2] -= extend
        budget[3] -= extend
        can_run.append(req)
        return self._budget_state(budget)

    def _add_chunked(self, req: _Req, budget: list) -> bool:
        """SGLang ``PrefillAdder.add_being_chunked_req``: the chunked request's next chunk, always taken; True when
        it is still not its last."""
        extend = req.prompt_len + req.num_generated - req.prefix_len
        truncated = extend > budget[3]
        extend = min(extend, budget[3])
        budget[0] += extend + (0 if truncated else min(req.max_tokens, self.params.clip_max_new_tokens))
        budget[1] += extend
        budget[2] -= extend
        budget[3] -= extend
        req.extend = extend
        return truncated

    def _budget_state(self, budget: list) -> int:
        free = self.available + self.cache.evictable_size
        if free - budget[0] <= 0 or free - budget[1] <= 0:
            return _NO_TOKEN
        if budget[2] <= 0 or budget[3] <= 0:
            return _OTHER
        return _CONTINUE

    def _admit(self, r: _Req, now: float, still_chunked: bool) -> None:
        """Allocate the request's extend tokens (evicting cache as needed) and count its first admission."""
        self._alloc(r.extend)
        r.private += r.extend
        if r.admitted_at is None:
            r.admitted_at = now
            r.cached_tokens = r.prefix_len
            self.prefix_cache_queries += r.prompt_len
            self.prefix_cache_hits += r.prefix_len
        if not still_chunked and r.request_id not in self._running:
            self._running[r.request_id] = r

    def _plan_prefill(self, now: float, batch: list[_Req]) -> Step:
        tokens = 0
        sampling: list[_Req] = []
        for r in batch:
            tokens += r.extend
            if r is not self._chunked:  # its last (or only) chunk: it samples a token
                sampling.append(r)
        duration = self.params.step_seconds(prefill_tokens=tokens, decode_seqs=0, decode_kv_tokens=0)
        end = now + duration
        done: list[_Req] = []
        outputs = tuple([self._emit(r, end, done) for r in sampling])
        step = Step(start=now, duration=duration, prefill_tokens=tokens, decode_seqs=0, outputs=outputs)
        self._in_flight = (step, list(batch), done)
        return step

    # ---- decode -----------------------------------------------------------------------------------------------

    def _plan_decode(self, now: float) -> Step:
        """SGLang ``update_running_batch`` (rules 4-5): check memory, retract or decay the ratio, decode one token
        for every running request."""
        running = self._running
        bs = len(running)
        retracted: tuple[str, ...] = ()
        if self.available < bs:
            self.available += self.cache.evict(bs)
            if self.available < bs:
                retracted = self._retract()
                bs = len(running)
        if not retracted:
            self.new_token_ratio = max(self.new_token_ratio - self.ratio_decay, self.min_ratio)
        if self.available < bs:
            raise RuntimeError("internal error: no KV token is free for the last running request")
        self.available -= bs
        kv_tokens = 0
        reqs = list(running.values())
        for r in reqs:
            r.private += 1
            kv_tokens += r.prompt_len + r.num_generated
        duration = self.params.step_seconds(prefill_tokens=0, decode_seqs=bs, decode_kv_tokens=kv_tokens)
        end = now + duration
        done: list[_Req] = []
        outputs = tuple([self._emit(r, end, done) for r in reqs])
        step = Step(start=now, duration=duration, prefill_tokens=0, decode_seqs=bs, outputs=outputs,
                    preempted=retracted)
        self._in_flight = (step, [], done)
        return step

    def _retract(self) -> tuple[str, ...]:
        """SGLang ``ScheduleBatch.retract_decode`` (rule 5); returns the retracted ids, victims first."""
        steps = self.params.retract_decode_steps
        order = sorted(self._running.values(), key=lambda r: (r.num_generated, -r.prompt_len), reverse=True)
        victims: list[_Req] = []
        while not victims or self.available < len(order) * steps:
            if len(order) == 1:
                break
            r = order.pop()
            victims.append(r)
            del self._running[r.request_id]
            self._free(r)
            r.prefix_len = 0
            r.retractions += 1
            self.retractions += 1
            self.available += self.cache.evict(max(0, len(order) * steps - self.available))
            self._waiting.append(r)
        kept = self._running.values()
        decoded = sum(r.num_generated for r in kept)
        self.new_token_ratio = min(1.0, (decoded + steps * len(kept)) / sum(r.max_tokens for r in kept))
        self._shrunk = True
        return tuple(r.request_id for r in victims)

    # ---- KV and cache -----------------------------------------------------------------------------------------

    def _alloc(self, n: int) -> None:
        if self.available < n:
            self.available += self.cache.evict(n - self.available)
            if self.available < n:
                raise RuntimeError(f"internal error: prefill needs {n} KV tokens, {self.available} free")
        self.available -= n

    def _free(self, r: _Req) -> None:
        """Return the request's private KV and unlock its cached prefix."""
        self.available += r.private
        r.private = 0
        if r.locked:
            self.cache.dec_lock_ref(r.last_node)
            r.locked = False

    def _cache_unfinished(self, r: _Req) -> None:
        """SGLang ``cache_unfinished_req``: insert what the request has computed, move its lock to the new node."""
        n = r.prefix_len + r.extend
        r.extend = 0
        key = r.fill(n)
        cache = self.cache
        old = cache.insert(key)
        new_tokens = n - old
        # Its private copies of tokens someone else cached meanwhile are freed; the new ones now live in the tree.
        self.available += r.private - new_tokens
        r.private = 0
        matched, node = cache.match_prefix(key)
        if r.locked:
            cache.dec_lock_ref(r.last_node)
        cache.inc_lock_ref(node)
        r.last_node, r.prefix_len, r.locked = node, matched, True

    def _cache_finished(self, r: _Req) -> None:
        """SGLang ``cache_finished_req``: insert prompt plus output less the last token, free the rest, unlock."""
        n = r.prompt_len + r.num_generated - 1
        old = self.cache.insert(r.fill(n))
        # Of its n tokens of KV, prefix_len were cached under its lock and n - old are new in the tree.
        self.available += r.private - (n - old)
        r.private = 0
        if r.locked:
            self.cache.dec_lock_ref(r.last_node)
            r.locked = False

    def _emit(self, r: _Req, end: float, done: list[_Req]) -> TokenOutput:
        """Sample ``r``'s next output token at ``end``; mark it done when that is its last."""
        index = r.num_generated
        r.num_generated = index + 1
        self.generation_tokens_total += 1
        if index == 0:
            r.first_token_at = end
            self.prompt_tokens_total += r.prompt_len
        finished = None
        if r.num_generated >= r.output_len:
            done.append(r)
            finished = FinishedRequest(
                request_id=r.request_id, prompt_tokens=r.prompt_len, cached_tokens=r.cached_tokens,
                completion_tokens=r.num_generated, finish_reason=r.finish_reason, submitted_at=r.submitted_at,
                admitted_at=r.admitted_at, first_token_at=r.first_token_at, finished_at=end,
                num_preemptions=r.retractions)
        return _new_tuple(TokenOutput, (r.request_id, index, r.seed, finished))
