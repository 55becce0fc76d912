"""A routing policy as a scheduling profile: plugins composed, not a subclass.

The shape is the Gateway API inference extension's endpoint picker (gateway-api-inference-extension, "Endpoint
Picker Protocol" and its scheduling framework: a SchedulerProfile runs filters, then scorers, then a picker), with
SkyLB's third kind of candidate beside local replicas and peer regions: holding the request in this balancer's queue.

* **Filters** (``Filter``): the router's own filters run first (serves the model, healthy and fresh, not drained,
  not ejected, Ollama fleet rules, room under selective pushing; skylb/core/candidates.py). A profile adds its own
  availability clauses (``unavailable_reason``), e.g. a replica's prefill backlog, and one per-request filter
  (``Admission``: ``admission``), e.g. room in a replica's KV cache for this request's prompt.
* **Pickers**: ``local`` (``ReplicaPicker``) chooses among local replicas with room, ``peer`` (``PeerPicker``) among
  peers with room. A picker scores and picks in one step, because every picker in use is lexicographic (a prefix
  match, then load, then turns), which weighted scorers cannot express without changing what they choose.
* **Rules** (``Rule``) decide between the kinds of candidate, in three places of the paper's order (SkyLB paper
  Algorithm 1, lines 27-30: a local replica with room, else a peer with room, else wait):
  ``first`` rules run before anything else and may settle the placement alone (a cache hit pushed into its
  holder's full batch; the predicted-TTFT placement that prices every candidate); ``then`` rules may overrule the
  local pick (a faster peer; holding for a faster busy replica); the ``no_room`` rule may forward a request no one
  has room for (first come, first served across regions). A rule answers a target, ``HOLD`` or None (no opinion).
  Each placement names the plugin that made it (``Candidates.rule``, then ``Decision.rule``: its module's name,
  ``plugin_name``), so an operator can see why a request went where it went.
* **Queue order** (``QueueOrder``): which of the first ``lookahead`` queued requests is placed next.
* **Learners**: what a profile's plugins learn from placements and membership (prefix tries, hash rings, trees);
  ``routed`` and ``set_members`` reach each once.
* **Estimator**: the prices the router and the peers read (a replica's estimated wait, the prompt tokens a replica
  must prefill, what this balancer advertises to peers).

Named policies (skylb/core/policies/) are functions from their typed options to a Profile.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from skylb.core.candidates import Candidates
from skylb.core.estimate import prompt_tokens
from skylb.core.kv_index import BlockIndex
from skylb.core.prefix_trie import PrefixTrie
from skylb.core.rates import RateBook
from skylb.core.request import Request
from skylb.core.state import PeerState, ReplicaState

__all__ = ["Profile", "HOLD", "Filter", "Admission", "ReplicaPicker", "PeerPicker", "Rule", "QueueOrder", "Learner",
           "Estimator", "Turns", "plugin_name"]


class _Hold:
    """The verdict "keep the request in this balancer's queue"."""

    def __repr__(self) -> str:
        return "HOLD"


#: A rule's verdict: the request stays queued here.
HOLD = _Hold()
Target = ReplicaState | PeerState


class Turns:
    """The turn counter a profile's plugins share to rotate among equals (one counter per balancer, so that every
    tie broken anywhere in one decision advances the same sequence)."""

    def __init__(self):
        self._count = itertools.count()

    def next(self) -> int:
        """The next turn (0, 1, 2, ...)."""
        return next(self._count)


class Filter(Protocol):
    """An availability clause beyond the router's (AvailabilityRules). Its verdict may depend only on the replica's
    fields and on the filter's own attributes, kept as scalars: the router memoizes availability per replica and
    compares those attributes at each decision (Router._availability_token)."""

    def unavailable_reason(self, replica: ReplicaState) -> str | None:
        """Why ``replica`` takes no request now, a short phrase; None: no objection."""


class Admission(Protocol):
    """Narrows the local candidates to those that can take this request (skylb/core/plugins/kv_admission.py)."""

    def narrow(self, request: Request, local: Sequence[ReplicaState], free: Sequence[ReplicaState],
               now: float | None = None) -> tuple[Sequence[ReplicaState], Sequence[ReplicaState]]:
        """(candidates, those of them with a free slot) for ``request`` at ``now`` (s)."""


class ReplicaPicker(Protocol):
    """Chooses among local replicas."""

    def pick(self, request: Request, candidates: Sequence[ReplicaState]) -> ReplicaState:
        """One of ``candidates`` (non-empty) for ``request``."""


class PeerPicker(Protocol):
    """Chooses among peer regions."""

    def pick(self, request: Request, candidates: Sequence[PeerState]) -> PeerState:
        """One of ``candidates`` (non-empty, peers with room) for ``request``."""


class Rule(Protocol):
    """A choice between kinds of candidate: ``decide(c, picked)`` -> a target, ``HOLD`` or None (no opinion);
    ``picked`` is the local pick for a ``then`` rule, None for ``first`` and ``no_room`` rules."""

    def decide(self, c: Candidates, picked: ReplicaState | None) -> Target | _Hold | None:
        """The rule's verdict on ``c``."""


class QueueOrder(Protocol):
    """Which queued request goes next."""

    def next_in_queue(self, window: Sequence[Request], local: Sequence[ReplicaState], peers: Sequence[PeerState],
                      replicas: Sequence[ReplicaState]) -> int:
        """Index in ``window`` (the first ``lookahead`` queued requests) of the one to place next, given the local
        replicas with room (``local``), the available peers and every local replica (``replicas``)."""


class Learner(Protocol):
    """Plugin state that learns from placements and membership (each method optional; ``prepare(request)``, also
    optional, works out per-request state when the request is queued)."""

    def routed(self, request: Request, *, replica: str | None = None, peer: str | None = None) -> None:
        """``request`` went to local replica ``replica`` or to peer region ``peer``."""

    def set_members(self, replicas: set[str], peers: set[str]) -> None:
        """The current local replica ids and peer regions (members that left are forgotten)."""


class Estimator:
    """Prices without a model: no wait estimate, every prompt token prefilled, nothing advertised. Profiles with a
    model (skylb/core/plugins/estimated_ttft.py, estimated_wait.py) pass their own."""

    def estimated_wait_s(self, replica: ReplicaState) -> float | None:
        """Seconds a new request would wait before its prefill starts on ``replica``; None: no estimate."""
        return None

    def uncached_tokens(self, request: Request, replica_id: str) -> int:
        """Prompt tokens of ``request`` replica ``replica_id`` is expected to prefill (skylb/core/estimate.py)."""
        return prompt_tokens(request)

    def advertised(self, available: Sequence[ReplicaState], replicas: Sequence[ReplicaState]) -> dict:
        """Extra PeerStatus fields told to peers (``available``: replicas with room, ``replicas``: all)."""
        return {}


def plugin_name(plugin: object) -> str:
    """The name a placement gives the plugin that made it: the last part of its class's module, one module per
    plugin (``push_to_holder``, ``prefer_peer``, ``estimated_ttft``...: skylb/core/plugins/)."""
    return type(plugin).__module__.rpartition(".")[2]


class Profile:
    """One named policy: its plugins, run in the order of the module docstring. Final: compose, do not subclass.

    Args:
        name: the registry name. options: the typed options it was built from.
        local, peer: the pickers. selective: offer only replicas with room (selective pushing) or every usable one.
        filters, admission, first, then, no_room: see the module docstring. queue: the queue order (None: first
        come, first served). lookahead: how many queued requests ``queue`` may choose among. max_bypass: how many
        times the head may be passed over. learners: plugin state told of placements and membership.
        estimator: the prices. rates: the measured replica speeds the router feeds (skylb/core/rates.py).
        reuse_freed_slots: a finished request frees its replica's place at once (False: the paper's rule, only a
        probe does). tries: (replica trie, regional snapshot trie) when the profile keeps them (benchmarks read
        them). pending_allowance: requests that may wait in a replica's own queue beyond its learned admission
        capacity when the balancer's settings leave it unset (skylb/core/capacity.py); the paper's policies keep
        0, their rule being that no request waits in an engine (SkyLB paper §3.3). untried_last: free slots at
        a place above a batch that a turnover left untried (skylb/core/capacity.py ``untried_at``) go after the
        sure ones while that batch turns over slowly, and a sure slot on a replica of a slower pace class does not
        go before a doubtful one (skylb/core/router.py ``Router._sure_first``); False: both as before them.
    """

    def __init__(self, name: str, options: Any, *, local: ReplicaPicker, peer: PeerPicker, selective: bool = True,
                 filters: Sequence[Filter] = (), admission: Admission | None = None, first: Sequence[Rule] = (),
                 then: Sequence[Rule] = (), no_room: Rule | None = None, queue: QueueOrder | None = None,
                 lookahead: int = 0, max_bypass: int = 0, learners: Iterable[Learner] = (),
                 estimator: Estimator | None = None, rates: RateBook | None = None, reuse_freed_slots: bool = True,
                 tries: tuple[PrefixTrie, PrefixTrie] | None = None, pending_allowance: int = 1,
                 untried_last: bool = False):
        self.name, self.options = name, options
        self.local, self.peer, self.selective = local, peer, selective
        self.filters, self.first, self.then, self.no_room = tuple(filters), tuple(first), tuple(then), no_room
        self.admission = admission
        self.queue = queue
        self.queue_lookahead = lookahead if queue is not None else 0
        self.max_bypass = max_bypass
        self.learners = tuple(learners)
        self.estimator = estimator or Estimator()
        self.rates = rates if rates is not None else RateBook()
        self.reuse_freed_slots = reuse_freed_slots
        self.replica_trie, self.snapshot_trie = tries if tries is not None else (None, None)
        self.pending_allowance = pending_allowance
        self.untried_last = untried_last
        # The plugins' names, worked out once: ``choose`` gives one to every placement.
        self._first_names = tuple(plugin_name(r) for r in self.first)
        self._then_names = tuple(plugin_name(r) for r in self.then)
        self._local_name, self._peer_name = plugin_name(local), plugin_name(peer)
        self._no_room_name = plugin_name(no_room) if no_room is not None else None

    def __repr__(self) -> str:
        return f"Profile({self.name!r})"

    def choose(self, c: Candidates) -> Target | None:
        """Where ``c.request`` goes now: a local replica, a peer, or None (it stays queued). ``c.rule`` is set to
        the name of the plugin that answered (``plugin_name``), a hold included."""
        for rule, name in zip(self.first, self._first_names):
            verdict = rule.decide(c, None)
            if verdict is not None:
                c.rule = name
                return None if verdict is HOLD else verdict
        if c.local:
            replica = self.local.pick(c.request, c.local)
            for rule, name in zip(self.then, self._then_names):
                verdict = rule.decide(c, replica)
                if verdict is not None:
                    c.rule = name
                    return None if verdict is HOLD else verdict
            c.rule = self._local_name
            return replica
        if c.peers:
            c.rule = self._peer_name
            return self.peer.pick(c.request, c.peers)
        if self.no_room is not None and c.request.may_forward and c.reachable:
            verdict = self.no_room.decide(c, None)
            if verdict is not None:
                c.rule = self._no_room_name
            return None if verdict is HOLD else verdict
        return None

    def next_in_queue(self, window: Sequence[Request], local: Sequence[ReplicaState], peers: Sequence[PeerState],
                      replicas: Sequence[ReplicaState]) -> int:
        """Index in ``window`` of the request to place next (QueueOrder; 0, the head, without one)."""
        return 0 if self.queue is None else self.queue.next_in_queue(window, local, peers, replicas)

    def prepare(self, request: Request) -> None:
        """Let every learner that keeps per-request state work it out as ``request`` is queued (``prepare``: its
        prefix trie key), so the decisions do not."""
        for learner in self.learners:
            if hasattr(learner, "prepare"):
                learner.prepare(request)

    def routed(self, request: Request, *, replica: str | None = None, peer: str | None = None) -> None:
        """Tell every learner that ``request`` went to local ``replica`` or to peer region ``peer``."""
        for learner in self.learners:
            if hasattr(learner, "routed"):
                learner.routed(request, replica=replica, peer=peer)

    def attach_kv_index(self, index: BlockIndex) -> None:
        """Give every learner that can use it (``attach_kv_index``) the block index of the engines' KV-cache events
        (skylb/core/kv_index.py BlockIndex), so cache locality is exact where the engines publish events."""
        for learner in self.learners:
            if hasattr(learner, "attach_kv_index"):
                learner.attach_kv_index(index)

    def kv_capacity(self, replica: str, tokens: int | None) -> None:
        """Tell every learner that keeps per-replica prefixes (``kv_capacity``) the KV-cache capacity local
        ``replica``'s engine reports, tokens (None: unknown)."""
        for learner in self.learners:
            if hasattr(learner, "kv_capacity"):
                learner.kv_capacity(replica, tokens)

    def set_members(self, replicas: Iterable[str], peers: Iterable[str]) -> None:
        """Tell every learner the current local replica ids and peer regions."""
        replicas, peers = set(replicas), set(peers)
        for learner in self.learners:
            if hasattr(learner, "set_members"):
                learner.set_members(replicas, peers)

    def share_prefixes(self) -> tuple[tuple[int, ...], int] | None:
        """The prefixes this balancer's replicas hold lately, for its siblings (the first learner that keeps them:
        ``PrefixLocality.share_prefixes``, which starts recording them), or None for a profile without."""
        for learner in self.learners:
            if hasattr(learner, "share_prefixes"):
                return learner.share_prefixes()
        return None

    def held_blocks(self) -> tuple[tuple[int, ...], int] | None:
        """The region summary of KV-cache blocks and their tokens per block, for peers (the first learner that keeps
        one: ``PrefixLocality.held_blocks``), or None (no block index, or a profile without)."""
        for learner in self.learners:
            if hasattr(learner, "held_blocks"):
                return learner.held_blocks()
        return None

    def replica_unavailable_reason(self, replica: ReplicaState) -> str | None:
        """The first filter's objection to ``replica``, or None."""
        for f in self.filters:
            reason = f.unavailable_reason(replica)
            if reason is not None:
                return reason
        return None

    def estimated_wait_s(self, replica: ReplicaState) -> float | None:
        """The estimator's wait on ``replica``, s (None: no estimate)."""
        return self.estimator.estimated_wait_s(replica)

    def uncached_tokens(self, request: Request, replica_id: str) -> int:
        """The estimator's prompt tokens of ``request`` to prefill on ``replica_id``."""
        return self.estimator.uncached_tokens(request, replica_id)

    def advertised(self, available: Sequence[ReplicaState], replicas: Sequence[ReplicaState]) -> dict:
        """The estimator's extra PeerStatus fields."""
        return self.estimator.advertised(available, replicas)
