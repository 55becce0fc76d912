"""The router: a balancer's FCFS queue, its view of targets, and the decision "where does the head go now".

Source: SkyLB paper Algorithm 1 (HANDLEREQUEST, lines 27-30) and §4.1 "Request life cycle": a request waits in a
first-come, first-served queue; at the head it goes to an available local replica if there is one, else to an
available peer (never for a request that came from a peer), else it stays at the head and everything waits behind it.
SkyLB narrows that wait to what the head can block: a request that cannot be placed holds back only the requests of
its candidate set (same model, dialect, exclusions), which keep FCFS order among themselves, and a request whose
model has no usable target is given back by ``unserved`` (503) after a bounded grace.
Beyond the paper, a policy may (skylb/core/policies/skylb.py): take a later request first when a free
replica holds its prefix (``queue_lookahead``, the head passed over at most ``max_bypass`` times), and forward the
head to a peer with no room but younger requests queued (``forward_queued``). The queue is ordered by
``Request.queued_since``, so a forwarded request keeps its age.

With priority classes on (``priorities``; off by default, and then nothing here changes), the queue is a
``ClassQueue`` (skylb/core/queue.py): the request that goes next is chosen by class (with aging), then tenant
by weighted deficit round robin, then age; look-ahead, bypass and forwarding apply to that chosen head as they do
to the FCFS head, the look-ahead window being the head's own tenant's later requests.

Pure: no I/O, no clock. Callers pass ``now`` (s, any monotonic clock) and apply the returned decisions. The live
balancer and the trace-driven simulator both drive this class.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from skylb.core.candidates import Candidates
from skylb.core.fleet_rules import FleetRules
from skylb.core.fleet_rules import load_s as fleet_load_s
from skylb.core.model_cards import peer_card
from skylb.core.queue import ClassQueue
from skylb.core.outlier import OutlierDetector
from skylb.core.profile import Profile
from skylb.core.estimate import PACE_CLASS_RATIO, pace_classes_apart, pace_slowdowns
from skylb.core.rates import Usage, request_chars
from skylb.core.request import Request
from skylb.core.state import AvailabilityRules, PeerState, PeerStatus, ReplicaState, ReplicaTable

__all__ = ["Router", "Decision", "QueueFull", "PINNED"]

#: ``Decision.rule`` of a request sent to its pinned target (``Router.place_pinned``), past every plugin.
PINNED = "pinned"

#: ``Router._free_rank`` of a free slot below any batch a request was seen waiting beside: such replicas go first.
_SURE = 2


class QueueFull(Exception):
    """Raised by ``Router.enqueue`` when the queue already holds ``max_queue`` requests."""


@dataclass(frozen=True)
class Decision:
    """Where one request goes.

    Attributes:
        request: the request; route: "local" (a local replica) or "peer" (forward to another region's balancer),
            the same word in the metric label, the log line and the ``X-SkyLB-Route`` header.
        target: the replica id or the peer region; url: the target's base URL.
        queued_s: time the request waited in the queue, s. dispatched_at: when the decision was made, s.
        rule: why: the name of the profile's plugin that chose the target (skylb/core/profile.py ``plugin_name``:
            ``push_to_holder``, ``prefer_peer``, ``estimated_ttft``...), or ``PINNED`` ("pinned") for a request
            sent to its pinned target; the same word in the metric label, the log line and the ``X-SkyLB-Rule``
            header.
    """

    request: Request
    route: str
    target: str
    url: str
    queued_s: float
    dispatched_at: float | None = None
    rule: str | None = None


class Router:
    """A region's routing state and FCFS queue.

    Args:
        region: this balancer's region.
        policy: the routing policy (see skylb.core.policies).
        rules: the availability rules (tau, staleness, dispatch cap).
        max_queue: the most requests the queue holds; more raise QueueFull.
        outlier: outlier detection (ejection of failing targets; skylb/core/outlier.py).
        fleet: the Ollama fleet rules (elimination, fit, hot preference; skylb/core/fleet_rules.py).
        priorities: order the queue by priority class and tenant (skylb/core/queue.py) instead of FCFS.
        aging_s: with ``priorities``, a request's class rises one step per this many seconds waited (0: never).
    """

    def __init__(self, *, region: str, policy: Profile, rules: AvailabilityRules | None = None,
                 max_queue: int = 10_000, outlier: OutlierDetector | None = None, fleet: FleetRules | None = None,
                 priorities: bool = False, aging_s: float = 0.0):
        self.region = region
        self.policy = policy
        self.rules = rules or AvailabilityRules()
        self.outlier = outlier or OutlierDetector()
        self.fleet = fleet or FleetRules()
        # With hot preference on, the estimated-wait policy counts a model's load time (0 where it is hot): total time =
        # queue wait + load time + inference time (the fleet router's "Routing Engine" guide, signal 1, with
        # OllamaRouter's estimate). Off, thermal state changes no routing (an unmeasured load time would keep requests
        # off a cold replica for good, and OllamaRouter's exploration of unmeasured replicas with it).
        if self.fleet.settings.hot_preference:
            default_load_s = self.fleet.settings.default_load_s
            self.policy.rates.load_s = lambda replica, model: fleet_load_s(replica, model, default_load_s)
        self.max_queue = max_queue
        self._availability_key: tuple | None = None
        self._availability_memo_token = object()
        self.replicas = ReplicaTable()
        self.peers: dict[str, PeerState] = {}
        #: The queue: FCFS (a deque in ``queued_since`` order), or by class and tenant with ``priorities``.
        self.queue: deque[Request] | ClassQueue = ClassQueue(aging_s=aging_s) if priorities else deque()
        self._bypassed: tuple[str | None, int] = (None, 0)
        self._placed_at: deque[float] = deque(maxlen=32)
        #: Decisions whose replica slot ``engine_done`` freed before ``finished``.
        self._engine_done: set[Decision] = set()
        #: Queued requests' candidate sets (``candidate_set``) by request id, as they were when queued, and how many
        #: queued requests each set has: a dispatch pass stops once every set queued is blocked.
        self._queued_sets: dict[str, tuple] = {}
        self._set_counts: dict[tuple, int] = {}
        #: Candidate set -> when ``unserved`` first found no usable target for it, s.
        self._unserved_since: dict[tuple, float] = {}
        #: Whether ``unsupported`` ever held a kind off a replica (until then a decision need not look).
        self._kinds_held = False

    # -- membership ---------------------------------------------------------------------------------------------
    def set_replicas(self, replicas: Iterable[tuple[str, str, str]], *,
                     max_concurrency: dict[str, int | None] | None = None) -> None:
        """Make the local replicas exactly ``replicas`` ((id, url, engine) triples).

        ``max_concurrency`` gives replicas' configured parallel slots by id: for engines without a pending metric
        the bound on this balancer's requests in flight there, for the others also the ceiling and starting point of
        the admission capacity learned from probes (skylb/core/capacity.py).

        A replica that left is drained: it gets no new requests and is dropped once its in-flight ones finish.
        A replica that comes back (same id) is un-drained.
        """
        wanted = {rid: (url, engine) for rid, url, engine in replicas}
        for rid, state in list(self.replicas.items()):
            if rid not in wanted:
                state.draining = True
                if state.outstanding == 0:
                    del self.replicas[rid]
        for rid, (url, engine) in wanted.items():
            state = self.replicas.get(rid)
            if state is None or state.url != url:
                self.replicas[rid] = ReplicaState(id=rid, url=url, engine=engine,
                                                  outstanding=state.outstanding if state else 0)
            else:
                state.draining = False
                state.engine = engine
            bound = (max_concurrency or {}).get(rid)
            self.replicas[rid].max_concurrency = bound
            self.replicas[rid].capacity.state_ceiling(bound)
        self._sync_policy()

    def set_peers(self, peers: Iterable[tuple[str, str]]) -> None:
        """Make the peers exactly ``peers`` ((region, url) pairs); this balancer's own region is ignored."""
        wanted = {region: url for region, url in peers if region != self.region}
        for region in list(self.peers):
            if region not in wanted:
                del self.peers[region]
        for region, url in wanted.items():
            state = self.peers.get(region)
            if state is None:
                self.peers[region] = PeerState(region=region, url=url)
            else:
                state.url = url
        self._sync_policy()

    def _sync_policy(self) -> None:
        self.policy.set_members([r for r, s in self.replicas.items() if not s.draining], self.peers)

    # -- the queue ----------------------------------------------------------------------------------------------
    @property
    def classes(self) -> ClassQueue | None:
        """The queue by priority class and tenant, or None when the queue is plain FCFS."""
        return self.queue if isinstance(self.queue, ClassQueue) else None

    def set_tenant_weights(self, weight_of: Callable[[str], float]) -> None:
        """Tenants' weights for deficit round robin (with priority classes): ``weight_of(tenant)`` > 0, read when a
        tenant's turn starts (so a change applies from the next turn). Ignored on a FCFS queue."""
        if self.classes is not None:
            self.classes.weight_of = weight_of

    def requeue(self, request: Request) -> None:
        """Put ``request`` back in its place (its target failed before the first byte): at the head, unless an older
        forwarded request is queued (``queued_since`` order, as ``enqueue`` keeps it); ignores ``max_queue``. With
        priority classes: at the front of its class, in age order among retries."""
        self._insert(request, retry=True)

    def enqueue(self, request: Request) -> None:
        """Add ``request`` to the FCFS queue in ``queued_since`` order: a client's request goes to the tail, a
        forwarded one before every request that joined a queue after it did (its wait at the forwarding balancer
        counts). Raises QueueFull when the queue is at ``max_queue``."""
        if len(self.queue) >= self.max_queue:
            raise QueueFull(f"queue is full ({self.max_queue} requests)")
        # What depends on the request alone (its character count, its prefix trie key) is worked out here, in its
        # own handler, rather than in the decision every queued request waits on (a 50,000-character prompt: about
        # 0.1 ms).
        request_chars(request)
        self.policy.prepare(request)
        self._insert(request)

    def _insert(self, request: Request, *, retry: bool = False) -> None:
        """Insert ``request`` in ``queued_since`` order (after those that joined at the same time); with classes,
        in its class and tenant (``retry``: ahead of its class's tenants)."""
        key = self.candidate_set(request)
        self._queued_sets[request.id] = key
        self._set_counts[key] = self._set_counts.get(key, 0) + 1
        if self.classes is not None:
            self.classes.add(request, retry=retry)
            return
        since = request.queued_since
        if not self.queue or self.queue[-1].queued_since <= since:
            self.queue.append(request)
            return
        # Forwarded requests are old, so their place is near the head: scan from there.
        for i, queued in enumerate(self.queue):
            if queued.queued_since > since:
                self.queue.insert(i, request)
                return

    def cancel(self, request_id: str) -> bool:
        """Remove a still-queued request (its client went away); True if it was queued."""
        if self.classes is not None:
            request = self.classes.cancel(request_id)
            if request is not None:
                self._left(request)
            return request is not None
        for i, r in enumerate(self.queue):
            if r.id == request_id:
                del self.queue[i]
                self._left(r)
                return True
        return False

    def _left(self, request: Request) -> None:
        """``request`` left the queue: forget its candidate set."""
        key = self._queued_sets.pop(request.id, None)
        if key is not None:
            n = self._set_counts.pop(key) - 1
            if n:
                self._set_counts[key] = n

    def expire(self, now: float, timeout_s: float) -> list[Request]:
        """Remove and return the requests that have waited longer than ``timeout_s`` at ``now``.

        A request's wait counts from ``queued_since`` (a forwarded request's wait at its first balancer included).
        Those times never decrease from the head (``enqueue`` and ``requeue`` keep the order), so only the head
        needs looking at: O(expired), not O(queue),
        per dispatch tick. With priority classes: each class's oldest through its age heap, O(classes + expired x
        log n).
        """
        if self.classes is not None:
            expired = self.classes.expire(now, timeout_s)
        else:
            expired = []
            while self.queue and now - self.queue[0].queued_since > timeout_s:
                expired.append(self.queue.popleft())
        for request in expired:
            self._left(request)
        return expired

    # -- decisions ----------------------------------------------------------------------------------------------
    def dispatch(self, now: float) -> list[Decision]:
        """Place requests from the queue while some can be placed; returns the decisions in order.

        The head (or the later request the policy's look-ahead picks) goes first. A request that cannot be placed
        holds back only the requests of its candidate set (``candidate_set``: same model, dialect, exclusions):
        they keep first-come, first-served order among themselves, and the pass goes on with the next request of
        another set, in the queue's order (with priority classes: the next of the tenant's, then the next tenant in
        rotation, then the next class). So a request whose only replicas are busy or failing never holds up one
        that a free replica serves. Each decision is already counted (outstanding, sent since probe, trie); call
        ``finished`` when its response ends.
        """
        out: list[Decision] = []
        classes = self.classes
        if classes is not None:
            classes.new_pass()
        blocked: set[tuple] = set()  # candidate sets whose oldest request could not be placed in this pass

        def is_blocked(request: Request) -> bool:
            return self._queued_sets.get(request.id) in blocked

        k = max(1, self.policy.queue_lookahead)
        # Every set queued blocked: nothing more can go (checked first, so a long queue of one blocked set costs
        # one placement attempt per pass, not a scan).
        while self.queue and len(blocked) < len(self._set_counts):
            if classes is None:
                window = list(itertools.islice((r for r in self.queue if not is_blocked(r)), k))
            else:
                window = classes.window(now, k, is_blocked if blocked else None)
            if not window:
                break
            i = self._next_index(now, window)
            decision = self._place(window[i], now)
            if decision is None and i:
                i, decision = 0, self._place(window[0], now)
            if decision is None:
                blocked.add(self._queued_sets[window[0].id])
                continue
            if i:
                head = window[0].id
                self._bypassed = (head, (self._bypassed[1] + 1) if self._bypassed[0] == head else 1)
            if classes is None:
                self.queue.remove(window[i])  # Request compares by identity (eq=False)
            else:
                classes.take(now, window[i])
            self._left(window[i])
            self._placed_at.append(now)
            out.append(decision)
        return out

    @staticmethod
    def candidate_set(request: Request) -> tuple:
        """What decides where ``request`` may go: (model, dialect, may be forwarded, targets to avoid, embedding).
        Two requests with the same set can be placed on the same targets, so they keep FCFS order between them."""
        return request.model, request.api, request.may_forward, request.avoid, request.embedding

    def unserved(self, now: float, grace_s: float) -> list[Request]:
        """Remove and return the queued requests whose model no usable target serves, once that has lasted
        ``grace_s`` s at ``now``.

        Usable: a local replica healthy, freshly probed, not draining, not ejected, serving the model in the
        request's dialect (or whose models are not known yet), or, for a request that may be forwarded, a peer
        reachable, not ejected and serving it; room does not matter (a busy target frees up). The time counts from
        the first call that found none for the request's candidate set, so with a call at least every dispatch tick
        a request waits at most ``grace_s`` plus one tick past the moment its model's last usable target went, then
        is answered (503) instead of waiting for ``queue_timeout_s``.
        """
        since = self._unserved_since
        for key in [key for key in since if key not in self._set_counts]:
            del since[key]
        gone: set[tuple] = set()
        for key in self._set_counts:
            if self._servable(key, now):
                since.pop(key, None)
            elif now - since.setdefault(key, now) >= grace_s:
                gone.add(key)
        if not gone:
            return []
        out = [r for r in self.queue if self._queued_sets.get(r.id) in gone]
        for request in out:
            self.cancel(request.id)
        return out

    def _servable(self, key: tuple, now: float) -> bool:
        """True when some usable target serves candidate set ``key``'s model (``unserved``)."""
        model, api, may_forward = key[:3]
        kind = "embeddings" if key[4] else "generation"
        if any((r.serves(model, api) or (r.models is None and api in r.apis)) and r.supports(kind, now)
               and self._replica_usable(r, now) for r in self.replicas.values()):
            return True
        return may_forward and any(self.rules.peer_unreachable_reason(p, now, model, api) is None
                                   and not self._ejected(p, now) for p in self.peers.values())

    def dispatch_rate(self, now: float) -> float | None:
        """Requests placed per second over the last placements (at most 32), up to ``now``; None before two."""
        if len(self._placed_at) < 2 or now <= self._placed_at[0]:
            return None
        return (len(self._placed_at) - 1) / (now - self._placed_at[0])

    def queue_age_s(self, now: float) -> float:
        """How long the oldest queued request has waited at ``now``, s (its wait at a forwarding balancer
        included); 0 when the queue is empty."""
        if self.classes is not None:
            since = self.classes.oldest_since()
            return 0.0 if since is None else max(0.0, now - since)
        return max(0.0, now - self.queue[0].queued_since) if self.queue else 0.0

    def _next_index(self, now: float, queue: deque[Request] | list[Request]) -> int:
        """Which request of ``queue`` (the FCFS queue, or the class queue's window) to place next: the head, unless
        the policy looks ahead (``Profile.queue_lookahead`` > 1) and picks a later one within that window, and the
        head has been passed over fewer than ``Profile.max_bypass`` times."""
        policy = self.policy
        k = policy.queue_lookahead
        if k <= 1 or len(queue) < 2 or policy.max_bypass <= 0:  # 0: never passed over (a new head had one before)
            return 0
        head = queue[0]
        if self._bypassed[0] == head.id and self._bypassed[1] >= policy.max_bypass:
            return 0
        window = list(itertools.islice(queue, k))
        local = (self.available_replicas(now) if policy.selective else
                 [r for r in self.replicas.values() if self._replica_usable(r, now)])
        peers = [p for p in self.peers.values() if self.peer_available(p, now, head.model, head.api)]
        if not local and not peers:
            return 0
        return policy.next_in_queue(window, local, peers, list(self.replicas.values()))

    def _place(self, request: Request, now: float) -> Decision | None:
        """Run the policy over ``request``'s candidates at ``now`` (skylb/core/candidates.py: the filters are
        here, the choice is the policy's ``choose``) and apply its choice; None: it stays queued."""
        model, api = request.model, request.api
        local, free, serving = self._local_candidates(request, now)
        fleet_local = self.fleet.candidates(model, api, local, list(self.replicas.values()), now,
                                            self.policy.estimated_wait_s, embedding=request.embedding,
                                            usable=self._replica_usable)
        if self.policy.selective and (len(fleet_local) != len(local) or request.embedding):
            free = self._with_free_slot(fleet_local, model)  # the fleet's rules took some out, or added embedding
        local = fleet_local
        peers = ([p for p in self.peers.values() if self.peer_available(p, now, model, api)]
                 if request.may_forward else [])
        peers = [p for p in peers if p.sibling] or peers  # a sibling with room first: the region's own replicas
        if self.policy.selective and len(local) > 1:  # free slots first: allowance or retest room when none is free
            local = free or local
        if request.avoid:
            local, peers = self._elsewhere(request, local, peers, now)
        c = Candidates(request, now, local, peers, len(self.queue), len(self.replicas), self.dispatch_rate(now),
                       _busy=lambda: self._busy(request, local, serving, now),
                       _reachable=lambda: [p for p in self.peers.values() if request.may_forward
                                           and self.rules.peer_unreachable_reason(p, now, model, api) is None
                                           and not self._ejected(p, now)])
        choice = self.policy.choose(c)
        if choice is None:
            return None
        return self._to_replica(request, choice, now, c.rule) if isinstance(choice, ReplicaState) else \
            self._to_peer(request, choice, now, c.rule)

    def _busy(self, request: Request, local: list[ReplicaState], serving: list[ReplicaState],
              now: float) -> list[ReplicaState]:
        """The usable replicas of ``serving`` (those serving ``request``) that are not among ``local`` (those with
        room) nor to be avoided: the full ones (``Candidates.busy``, worked out only when a plugin asks)."""
        taken = {r.id for r in local}  # by id: a dataclass ``in`` compares every field of every replica
        return [r for r in serving if r.id not in taken and ("local", r.id) not in request.avoid
                and self._replica_usable(r, now)]

    def _local_candidates(self, request: Request,
                          now: float) -> tuple[list[ReplicaState], list[ReplicaState], list[ReplicaState]]:
        """(candidates, those of them with a free slot, serving) at ``now``: the local replicas serving
        ``request``'s model in its dialect and requests of its kind (serving), those that may take it (with room
        under selective pushing: ``replica_available``, memoized; usable under blind pushing) and, under selective
        pushing, those with a free slot (``AvailabilityRules.has_free_slot``; empty under blind pushing): only those
        below a batch a request was seen waiting beside (``AvailabilityRules.below_waited_batch``) when any is;
        with the profile's ``admission`` filter, only those whose KV cache can take ``request`` when any can."""
        model, api, kind = request.model, request.api, request.kind
        serving = self.replicas.serving(model, api)
        if self._kinds_held and any(r.unsupported for r in serving):  # a replica answered 501 for a kind lately
            serving = [r for r in serving if not r.unsupported or r.supports(kind, now)]
        if not self.policy.selective:
            return [r for r in serving if self._replica_usable(r, now)], [], serving
        # ``_available``'s memo test written out in the loop: this pass runs over every replica on every decision,
        # and a call per replica was most of a decision's time at 200 replicas (bench/micro/coordination.py).
        token, stale_s, remember = self._availability_token(), self.rules.stale_after_s, self._remember
        out, free, sure = [], [], []
        for r in serving:
            memo = r.availability_memo
            if (memo is None or memo[0] is not token or memo[2] != r.capacity.limit
                    or memo[3] != len(r.dispatch_times)
                    or (memo[1] is not None and now - memo[1] > stale_s + r.stale_grace_s)):
                memo = remember(r, now, token)
            if memo[4] is None:
                out.append(r)
                if memo[5]:
                    free.append(r)
                    if memo[5] == _SURE:
                        sure.append(r)
        ranked = self._sure_first(model, sure, free)
        if self.policy.admission is not None and out:  # room for this request's prompt (and output) in KV caches
            out, picked = self.policy.admission.narrow(request, out, ranked, now)
            return list(out), list(picked), serving
        return out, ranked, serving

    def _with_free_slot(self, replicas: list[ReplicaState], model: str) -> list[ReplicaState]:
        """Those of ``replicas`` with a free slot, as ``_local_candidates`` picks them, from the availability memo
        the same decision just checked when it still holds, else worked out."""
        token, rank = self._availability_memo_token, self._free_rank
        free, sure = [], []
        for r in replicas:
            memo = r.availability_memo
            held = (memo is not None and memo[0] is token and memo[2] == r.capacity.limit
                    and memo[3] == len(r.dispatch_times))
            slot = memo[5] if held else rank(r)
            if slot:
                free.append(r)
                if slot == _SURE:
                    sure.append(r)
        return self._sure_first(model, sure, free)

    def _sure_first(self, model: str, sure: list[ReplicaState], free: list[ReplicaState]) -> list[ReplicaState]:
        """The replicas of ``free`` (those with a free slot) that go first: ``sure`` (those below every batch a
        request was seen waiting beside, ``AvailabilityRules.below_waited_batch``), unless every one of them is
        measured to be of a slower class (``PACE_CLASS_RATIO``, skylb/core/estimate.py) than one of the others:
        a doubtful place on a replica several times faster is worth its risk (simulated, replicas of two speeds 4x
        apart at half load: P90 TTFT 1.23x over 12 seeds when the slow replicas' sure places went first,
        bench/results/untried_place.md); ``free`` when none is sure. Without the profile's ``untried_last``,
        ``sure`` whenever any is."""
        if not sure or len(sure) == len(free) or not self.policy.untried_last:
            return sure or free
        # ReplicaRates.for_model written out, as in the estimate's pace classes.
        paces = [m if (m := r.rates.models.get(model)) is not None and m.samples and m.time_per_token_s is not None
                 else None for r in free]
        if not pace_classes_apart(paces, PACE_CLASS_RATIO):
            return sure
        sure_ids = {r.id for r in sure}
        if any(r.id in sure_ids and (x is None or x < PACE_CLASS_RATIO) for r, x in zip(free, pace_slowdowns(paces))):
            return sure
        return free

    def _free_rank(self, replica: ReplicaState) -> int:
        """0: no free slot (``AvailabilityRules.has_free_slot``); 1: one, at or above a batch a request was seen
        waiting beside; ``_SURE`` (2): one below any such batch (``AvailabilityRules.below_waited_batch``)."""
        if not self.rules.has_free_slot(replica):
            return 0
        return _SURE if self.rules.below_waited_batch(replica, untried=self.policy.untried_last) else 1

    def _availability_token(self) -> object:
        """An object that stays the same while every router-wide input of ``replica_unavailable_reason`` does (the
        policy and its filters, the availability rules, the fleet's settings); a memo made under another token is
        not used."""
        fleet = self.fleet.settings
        key = (id(self.policy), *(tuple(vars(f).values()) for f in self.policy.filters), id(self.rules),
               tuple(vars(self.rules).values()), id(fleet), tuple(fleet.paused))
        if key != self._availability_key:
            self._availability_key, self._availability_memo_token = key, object()
        return self._availability_memo_token

    def _available(self, replica: ReplicaState, now: float, token: object) -> bool:
        """``replica_available(replica, now)``, from the replica's memo while nothing it depends on changed: no
        field of the replica was written since (ReplicaState clears the memo on any write), the router-wide inputs
        are the same (``token``), its probe is as fresh by the same test as the rules', and it is not ejected
        (ejection ends with time and with its population's panic, so it is always checked). A decision over 200
        replicas then checks only those that changed since the previous one."""
        memo = replica.availability_memo
        if (memo is not None and memo[0] is token and memo[2] == replica.capacity.limit
                and memo[3] == len(replica.dispatch_times)
                and (memo[1] is None or now - memo[1] <= self.rules.stale_after_s + replica.stale_grace_s)):
            return memo[4] is None
        return self._remember(replica, now, token)[4] is None

    def _remember(self, replica: ReplicaState, now: float, token: object) -> tuple:
        """Work out ``replica``'s availability at ``now`` and keep it as its memo (not while an ejection is on
        record): (``token``, ``probed_at``, the capacity's limit, ``sent_since_probe``, the reason or None, its free
        slot as ``_free_rank`` ranks it). Returns the memo."""
        memo = (token, replica.probed_at, replica.capacity.limit, len(replica.dispatch_times),
                self.replica_unavailable_reason(replica, now), self._free_rank(replica))
        if replica.ejected_until is None:
            # The learned capacity and the requests sent since the probe change in place, not by a write of a field:
            # the memo holds them to compare.
            replica.availability_memo = memo
        return memo

    def _to_replica(self, request: Request, replica: ReplicaState, now: float, rule: str | None) -> Decision:
        """Send ``request`` to local ``replica`` at ``now`` by ``rule`` (``Decision.rule``): count it there
        (outstanding, prefill backlog, rates, trie, fleet) and return the decision."""
        policy = self.policy
        replica.outstanding += 1
        replica.dispatch_times.append(now)
        replica.served += 1
        replica.add_unprefilled(request.id, policy.uncached_tokens(request, replica.id))
        replica.add_reserved(request.id, request.max_tokens)
        policy.rates.dispatched(replica.rates, request.id, request.model, request.text, chars=request_chars(request))
        policy.routed(request, replica=replica.id)
        self.fleet.routed(request, replica)
        return Decision(request, "local", replica.id, replica.url, now - request.arrived_at, now, rule)

    def _to_peer(self, request: Request, peer: PeerState, now: float, rule: str | None) -> Decision:
        """Forward ``request`` to ``peer`` at ``now`` by ``rule`` (``Decision.rule``): count it there and return
        the decision."""
        peer.outstanding += 1
        peer.sent_since_probe += 1
        self.policy.routed(request, peer=peer.region)
        return Decision(request, "peer", peer.region, peer.url, now - request.arrived_at, now, rule)

    def forward_answered(self, decision: Decision) -> None:
        """The forward ``decision`` gave the client its answer: count it at its peer (``PeerState.forwarded``, the
        status' per-peer count). An attempt retried before its first byte is not counted, so a retried forward
        counts once, where it was answered, as a client's report counts it (by ``X-SkyLB-Route``)."""
        peer = self.peers.get(decision.target) if decision.route == "peer" else None
        if peer is not None:
            peer.forwarded += 1

    def pinned_unavailable_reason(self, pin: tuple[str, str], now: float, *, may_forward: bool = True,
                                  model: str = "", api: str = "openai") -> tuple[str, str] | None:
        """Why target ``pin`` (("local", replica id) or ("peer", region)) cannot take a request (for ``model`` in
        dialect ``api``; ``may_forward``: not itself forwarded) at ``now``, as (kind, words), or None when it can.
        kind "gone": the target left (a replica no longer in membership or draining, a peer no longer known, a
        forwarded request pinned to a peer: one hop); "unavailable": it is there but unusable now (unhealthy, its
        probe stale, ejected; it may come back). Busy is no reason: the target is the only one that can serve it,
        so it queues there rather than here."""
        route, target = pin
        if route == "local":
            replica = self.replicas.get(target)
            if replica is None or replica.draining:
                return "gone", f"replica {target} left this region's membership"
            if not self._replica_usable(replica, now):
                reason = self.rules.replica_unavailable_reason(replica, now) or "ejected (outlier detection)"
                return "unavailable", f"replica {target} is unavailable now: {reason}"
            return None
        peer = self.peers.get(target)
        if peer is None or not may_forward:
            return "gone", (f"region {target}'s balancer is not a peer now" if peer is None
                            else "a forwarded request is never forwarded again")
        reason = self.rules.peer_unreachable_reason(peer, now, model, api)
        if reason is None and self._ejected(peer, now):
            reason = "ejected (outlier detection)"
        return None if reason is None else ("unavailable", f"region {target}'s balancer is unavailable now: {reason}")

    def place_pinned(self, request: Request, now: float) -> Decision | None:
        """Send ``request`` to its pinned target (``request.pin``) at once, bypassing the queue (blind pushing to
        the one target that can serve it: waiting here would only hold up the requests behind it); None when
        ``pinned_unavailable_reason`` gives a reason. Count and release the decision as any other."""
        if self.pinned_unavailable_reason(request.pin, now, may_forward=request.may_forward, model=request.model,
                                          api=request.api) is not None:
            return None
        route, target = request.pin
        if route == "local":
            return self._to_replica(request, self.replicas[target], now, PINNED)
        return self._to_peer(request, self.peers[target], now, PINNED)

    def first_token(self, decision: Decision, now: float | None = None) -> None:
        """``decision``'s first token came back (at ``now``, s, when given): its prompt no longer waits for prefill
        on its replica, and from ``now`` it generates (``ReplicaState.reserve_started``)."""
        if decision.route == "local":
            state = self.replicas.get(decision.target)
            if state is not None:
                state.prefilled(decision.request.id)
                if now is not None and state.reserved:
                    state.reserve_started(decision.request.id, now, decision.request.max_tokens)

    def observe_response(self, decision: Decision, usage: Usage, *, ttft_s: float | None, e2e_s: float) -> bool:
        """Learn the replica's speed from ``decision``'s response (skylb/core/rates.py, OllamaRouter §4.3): ``usage``
        as the response reported it, ``ttft_s`` and ``e2e_s`` measured from dispatch (s). Call before
        ``finished``. Returns False when nothing was learned (a peer's, or no token counts)."""
        state = self.replicas.get(decision.target) if decision.route == "local" else None
        if state is None:
            return False
        return self.policy.rates.observe(state.rates, decision.request.id, usage, ttft_s=ttft_s, e2e_s=e2e_s)

    def engine_done(self, decision: Decision, now: float | None = None) -> None:
        """``decision``'s replica finished it (a stream's last event arrived): free its place there now, before the
        client reads the end of the answer and, closed-loop, sends its next request at once (it found every batch
        full by this count, and the pending allowance sent it into a full batch). ``finished`` does the rest.
        ``now`` (s): when, so that a probe answer that left before it and arrives after it is corrected
        (ReplicaState.slot_freed)."""
        state = self.replicas.get(decision.target) if decision.route == "local" else None
        if state is None or decision in self._engine_done:
            return
        self._engine_done.add(decision)
        self._free_slot(state, decision, now)

    def _free_slot(self, state: ReplicaState, decision: Decision, now: float | None) -> None:
        state.outstanding = max(0, state.outstanding - 1)
        state.release_reserved(decision.request.id)
        if self.policy.reuse_freed_slots and decision.dispatched_at is not None:
            state.slot_freed(decision.dispatched_at, now)

    def finished(self, decision: Decision, now: float | None = None) -> None:
        """The response of ``decision`` ended (any outcome) at ``now`` (s; see ``engine_done``): release its
        outstanding count (never below 0)."""
        if decision.route == "local":
            state = self.replicas.get(decision.target)
            self.fleet.finished(decision.request, state)
            early = decision in self._engine_done
            self._engine_done.discard(decision)
            if state is not None:
                if not early:
                    self._free_slot(state, decision, now)
                state.prefilled(decision.request.id)
                self.policy.rates.released(state.rates, decision.request.id)
                if state.draining and state.outstanding == 0:
                    del self.replicas[decision.target]
        else:
            peer = self.peers.get(decision.target)
            if peer is not None:
                peer.outstanding = max(0, peer.outstanding - 1)

    # -- outlier detection (passive health checking) ----------------------------------------------------------------
    def target_failed(self, decision: Decision, *, now: float, gateway: bool = True) -> bool:
        """``decision``'s target failed at ``now``: a gateway failure (refused, reset, timed out before the first
        byte, 502/503/504: ``gateway``) or another 5xx answer. Counts it for outlier detection (Envoy's
        ``consecutive_gateway_failure`` / ``consecutive_5xx``); returns True when the target was ejected now."""
        population = self.replicas if decision.route == "local" else self.peers
        state = population.get(decision.target)
        if state is None:
            return False
        return self.outlier.failed(state, population.values(), now=now, gateway=gateway)

    def target_answered(self, decision: Decision) -> None:
        """``decision``'s target answered without a 5xx: its runs of failures are over."""
        state = (self.replicas if decision.route == "local" else self.peers).get(decision.target)
        if state is not None:
            self.outlier.answered(state)

    def _ejected(self, state: ReplicaState | PeerState, now: float) -> bool:
        """True when ``state`` is ejected at ``now`` and its population (replicas or peers) is not in panic."""
        if not self.outlier.is_ejected(state, now):
            return False
        population = self.replicas if isinstance(state, ReplicaState) else self.peers
        return not self.outlier.panic([t for t in population.values() if not getattr(t, "draining", False)], now)

    def _elsewhere(self, request: Request, local: list[ReplicaState], peers: list[PeerState],
                   now: float) -> tuple[list[ReplicaState], list[PeerState]]:
        """A retry's candidates: without the targets that failed it (``request.avoid``) while another target that
        serves its model is usable (healthy, fresh, not ejected; it may be busy, then the request waits for it).
        With none, the failed targets stay candidates rather than the request waiting for nothing (a replica of
        another model does not count: it will never take this request)."""
        avoid = request.avoid
        if not self.served_elsewhere(request, now):
            return local, peers
        return ([r for r in local if ("local", r.id) not in avoid],
                [p for p in peers if ("peer", p.region) not in avoid])

    def served_elsewhere(self, request: Request, now: float) -> bool:
        """True when a usable target other than those ``request`` avoids could serve it: a local replica serving its
        model, dialect and kind (``ReplicaState.supports``), healthy, fresh and not ejected, or (for a request that
        may be forwarded) a reachable peer serving its model; busy or not."""
        avoid, model, api, kind = request.avoid, request.model, request.api, request.kind
        return (any(("local", r.id) not in avoid and r.serves(model, api) and r.supports(kind, now)
                    and self._replica_usable(r, now) for r in self.replicas.values())
                or any(("peer", p.region) not in avoid and request.may_forward
                       and self.rules.peer_unreachable_reason(p, now, model, api) is None
                       and not self._ejected(p, now) for p in self.peers.values()))

    def unsupported(self, decision: Decision, now: float, hold_s: float) -> None:
        """``decision``'s local replica answered 501 Not Implemented: send it no request of that kind for
        ``hold_s`` s from ``now`` (``ReplicaState.unsupported``). A peer's 501 is not recorded: the request avoids
        it on its retry, and another request of the kind may find a replica there that serves it."""
        replica = self.replicas.get(decision.target) if decision.route == "local" else None
        if replica is not None:
            replica.unsupported[decision.request.kind] = now + hold_s
            self._kinds_held = True

    def _replica_usable(self, replica: ReplicaState, now: float) -> bool:
        """Blind pushing's rule: healthy, fresh, not draining (pending ignored), and not ejected."""
        return self.rules.replica_usable(replica, now) and not self._ejected(replica, now)

    def peer_unavailable_reason(self, peer: PeerState, now: float, model: str = "",
                                api: str = "openai") -> str | None:
        """None when requests may be forwarded to ``peer`` at ``now``: the availability rules, then ejection."""
        reason = self.rules.peer_unavailable_reason(peer, now, model, api)
        if reason is None and self._ejected(peer, now):
            return "ejected (outlier detection)"
        return reason

    def peer_gone_reason(self, region: str, now: float) -> str | None:
        """Why a request forwarded to peer ``region``, still waiting for its first byte, is to be given up (the peer
        left, or is unreachable: its status stale or failing, a partition), else None. A stale status is not taken
        for a partition while this balancer's probes of its own replicas are as stale: then its own event loop ran
        late (a starved CPU held every prober back), and the peer may be answering (measured: 3 forwarded requests
        of 790 given up at a load average of 20 on 2 cores)."""
        peer = self.peers.get(region)
        if peer is None:
            return "left membership"
        reason = self.rules.peer_unreachable_reason(peer, now)
        if reason == "status stale" and self.replicas:
            newest = max(r.probed_at or 0.0 for r in self.replicas.values())
            if now - newest > self.rules.peer_stale_s(peer):
                return None
        return reason

    def peer_available(self, peer: PeerState, now: float, model: str = "", api: str = "openai") -> bool:
        """True when requests (for ``model`` in dialect ``api``) may be forwarded to ``peer`` now."""
        return self.peer_unavailable_reason(peer, now, model, api) is None

    # -- probes and status --------------------------------------------------------------------------------------
    def observe_replica(self, replica_id: str, *, now: float, healthy: bool, pending: int = 0,
                        running: int | None = None, error: str | None = None, slots: int | None = None,
                        probe_sent_at: float | None = None, kv_usage: float | None = None,
                        kv_capacity_tokens: int | None = None, output_reserve_tokens: int | None = None,
                        output_reserve_ratio: float | None = None) -> None:
        """Record a probe answer for a local replica (ignored if the replica left); see ReplicaState.observe_probe.
        Its availability is worked out now, when the answer arrives, rather than by the next decision: a probe
        round answers for every replica within a few ms, and the decision after it would otherwise check them
        all (the decision's p99 at 200 replicas)."""
        state = self.replicas.get(replica_id)
        if state is not None:
            capacity = state.kv_capacity_tokens
            state.observe_probe(now=now, healthy=healthy, pending=pending, running=running, error=error,
                                slots=slots, probe_sent_at=probe_sent_at, kv_usage=kv_usage,
                                kv_capacity_tokens=kv_capacity_tokens, output_reserve_tokens=output_reserve_tokens,
                                output_reserve_ratio=output_reserve_ratio)
            if state.kv_capacity_tokens != capacity:  # the prefixes it can hold (PrefixLocality.kv_capacity)
                self.policy.kv_capacity(replica_id, state.kv_capacity_tokens)
            if self.policy.selective:
                self._available(state, now, self._availability_token())

    def observe_peer(self, region: str, *, now: float, status: PeerStatus | None,
                     error: str | None = None, rtt_s: float | None = None) -> None:
        """Record a peer's status (``status``) or that it failed (``status`` None, ``error`` why), with the round
        trip of the probe that brought it (``rtt_s``, s); ignored if the peer left."""
        state = self.peers.get(region)
        if state is not None:
            state.observe_status(now=now, status=status, error=error, rtt_s=rtt_s)

    def set_replica_models(self, replica_id: str, models: list[str]) -> None:
        """Record the model ids a local replica serves (learned from the replica)."""
        state = self.replicas.get(replica_id)
        if state is not None:
            state.models = frozenset(models)

    def served_models(self, api: str = "openai", *, with_peers: bool = True) -> set[str]:
        """Models some local replica (and, ``with_peers``, some healthy peer) serves in dialect ``api``."""
        models = {m for r in self.replicas.values() if not r.draining and r.models and api in r.apis
                  for m in r.models}
        if with_peers:
            for p in self.peers.values():
                if p.healthy and p.models:
                    models.update(p.models.get(api, {}))
        return models

    def models_known(self) -> bool:
        """True when every healthy local replica and healthy peer has told which models it serves, and none has yet
        to answer its first probe: a replica that just joined (or joined again after membership dropped it) serves
        what it serves within a probe, so a request for its model waits for that answer in the queue rather than
        being told at once that nothing reachable serves it."""
        return (all(r.models is not None for r in self.replicas.values()
                    if (r.healthy or r.probed_at is None) and not r.draining)
                and all(p.models is not None for p in self.peers.values() if p.healthy or p.probed_at is None))

    def unreachable_unlisted(self, *, with_peers: bool = True) -> list[tuple[str, str]]:
        """(url, why) of each local replica (and, ``with_peers``, each peer) that is not healthy and has never said
        which models it serves (not probed yet, or unreachable since it joined), so it may serve any model; draining
        replicas left and are not counted. Replicas first, each group in membership order."""
        found = [(r.url, r.error or "not probed yet") for r in self.replicas.values()
                 if not r.draining and not r.healthy and r.models is None]
        if with_peers:
            found += [(p.url, p.error or "not probed yet") for p in self.peers.values()
                      if not p.healthy and p.models is None]
        return found

    def replica_unavailable_reason(self, replica: ReplicaState, now: float) -> str | None:
        """None when ``replica`` may take a request at ``now`` under selective pushing: the availability rules'
        reason first, then ejection by outlier detection, then the policy's own clause (for status and metrics)."""
        reason = self.rules.replica_unavailable_reason(replica, now)
        if reason is not None:
            return reason
        # ``ejected_until`` first: this runs for every replica on every decision, and few are ever ejected.
        if replica.ejected_until is not None and self._ejected(replica, now):
            return "ejected (outlier detection)"
        return self.fleet.eliminated(replica, "", now) or self.policy.replica_unavailable_reason(replica)

    def replica_available(self, replica: ReplicaState, now: float) -> bool:
        """True when ``replica`` may take a request at ``now`` under selective pushing."""
        return self.replica_unavailable_reason(replica, now) is None

    def available_replicas(self, now: float) -> list[ReplicaState]:
        """Local replicas available at ``now`` under selective pushing."""
        token = self._availability_token()
        return [r for r in self.replicas.values() if self._available(r, now, token)]

    def status(self, now: float) -> PeerStatus:
        """What this balancer tells its peers: its available replicas, replicas and queue length, and per API
        dialect every model a local replica serves with how many of those replicas are available now (0 included,
        so a peer knows the model is served here even when all are busy), what those replicas' engines say of each
        model (``peer_card``), and the policy's estimated wait on the best available replica (ms; None without one
        or without an estimate); with a sibling, the prefixes its replicas hold lately (``PeerStatus.prefixes``);
        following KV-cache events, the region summary of the blocks its replicas hold (``PeerStatus.blocks``); the
        mean requests in its usable replicas' engines (``PeerStatus.load_per_replica``)."""
        available = self.available_replicas(now)
        available_ids = {r.id for r in available}
        models: dict[str, dict[str, int]] = {}
        for r in self.replicas.values():
            if r.draining or not r.models:
                continue
            for api in r.apis:
                per_api = models.setdefault(api, {})
                for m in r.models:
                    per_api[m] = per_api.get(m, 0) + (r.id in available_ids)
        serving = sorted((r for r in self.replicas.values() if not r.draining and r.models), key=lambda r: r.id)
        cards = {m: peer_card(m, [r.model_cards[m] for r in serving if m in r.model_cards])
                 for m in sorted({m for r in serving for m in r.models})}
        waits = [w for w in map(self.policy.estimated_wait_s, available) if w is not None]
        extra = self.policy.advertised(available, [r for r in self.replicas.values() if not r.draining])
        # Prefixes only while a sibling listens (skylb/core/held_prefixes.py): without one, nothing is recorded.
        shared = self.policy.share_prefixes() if any(p.sibling for p in self.peers.values()) else None
        if shared is not None:
            extra = {**extra, "prefixes": shared[0], "prefix_seq": shared[1]}
        held = self.policy.held_blocks()  # with KV-cache events: what the region's engines hold (kv_index.py)
        if held is not None:
            extra = {**extra, "blocks": held[0], "block_size": held[1]}
        usable = [r.in_engine for r in self.replicas.values() if r.healthy and not r.draining]
        if usable:
            extra = {**extra, "load_per_replica": round(sum(usable) / len(usable), 3)}
        return PeerStatus(region=self.region, available_replicas=len(available),
                          replicas=sum(1 for r in self.replicas.values() if not r.draining),
                          queue_len=len(self.queue), models=models,
                          wait_ms=round(min(waits) * 1000.0, 3) if waits else None,
                          queue_age_ms=round(self.queue_age_s(now) * 1000.0, 3),
                          dispatch_rate=self.dispatch_rate(now),
                          model_cards={m: c for m, c in cards.items() if c is not None} or None, **extra)
