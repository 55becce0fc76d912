"""The policy interface, its registry, and typed options.

A policy answers two narrow questions (pick a local replica, pick a peer) among candidates the router already
filtered, and learns from each decision. Each policy registers itself by name (``class X(Policy, name="x")``;
SkyServe's registry pattern) and declares its options as a frozen pydantic dataclass ``Options``: unknown and
ill-typed options are errors, so a misspelt setting never falls back to a default silently.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar

from pydantic import ConfigDict, ValidationError
from pydantic.dataclasses import dataclass

from skylb.core.candidates import Candidates
from skylb.core.estimate import prompt_tokens
from skylb.core.policies import scoring
from skylb.core.rates import RateBook
from skylb.core.request import Request
from skylb.core.state import PeerState, ReplicaState

__all__ = ["Policy", "POLICIES", "PolicyError", "make_policy", "policy_options", "policy_names", "options_class"]

#: name -> policy class, filled by ``Policy.__init_subclass__``.
POLICIES: dict[str, type["Policy"]] = {}

#: What every policy's Options dataclass is declared with: frozen, unknown keys rejected.
OPTIONS_CONFIG = ConfigDict(extra="forbid")


class PolicyError(ValueError):
    """An unknown policy name, or options a policy does not declare or that fail its validation."""


@dataclass(frozen=True, config=OPTIONS_CONFIG)
class NoOptions:
    """Options of a policy that has none."""


class Policy:
    """Base class: chooses among candidates the router already filtered; subclasses register with ``name=``.

    Class attributes:
        name: the registry name (one spelling: lower case, words joined by '-').
        selective: True when the router offers only available replicas (selective pushing), False when it offers
            every healthy one (blind pushing).
        Options: the policy's options dataclass; ``self.options`` holds the instance it was built with.
        reuse_freed_slots: True when a finished request frees its replica's place at once
            (``ReplicaState.slot_freed``: the head of the queue goes there before the next probe); False keeps
            the paper's rule, where only a probe makes a replica available again.
        queue_lookahead: how many queued requests from the head ``next_in_queue`` may choose among (0 or 1:
            first come, first served). max_bypass: how many times the head may be passed over before it goes.
    """

    name: ClassVar[str]
    selective: ClassVar[bool] = True
    Options: ClassVar[type] = NoOptions
    reuse_freed_slots: ClassVar[bool] = True
    queue_lookahead: int = 0
    #: Whether ``hold_for_faster`` may keep a request queued (the Router skips building its arguments otherwise).
    holds_for_faster: bool = False
    max_bypass: int = 0

    def __init_subclass__(cls, *, name: str | None = None, **kwargs):
        super().__init_subclass__(**kwargs)
        if name:
            if name != name.lower() or "_" in name or " " in name:
                raise ValueError(f"policy name {name!r}: lower case, words joined by '-'")
            cls.name = name
            POLICIES[name] = cls

    def __init__(self, options: Any = None):
        self.options = options if options is not None else self.Options()
        self._rotation = itertools.count()
        #: Measured replica speeds (skylb/core/rates.py): the Router feeds it whatever the policy; a policy that
        #: learns with other settings replaces it in its own __init__.
        self.rates = RateBook()

    def choose(self, c: Candidates) -> ReplicaState | PeerState | None:
        """Where ``c.request`` goes now among its candidates ``c`` (skylb/core/candidates.py): a local replica, a
        peer, or None (it stays queued). Default, the paper's order (Algorithm 1 lines 27-30) with this base's
        hooks: a local replica with room (``pick_replica``), unless ``prefer_peer`` names a peer or
        ``hold_for_faster`` keeps it for a busy faster replica; else an available peer (``pick_peer``); else a
        peer with a younger queue (``forward_queued``); else it waits."""
        request = c.request
        if c.local:
            replica = self.pick_replica(request, c.local)
            peer = self.prefer_peer(request, replica, c.peers) if c.peers else None
            if peer is not None:
                return peer
            if (self.holds_for_faster and len(c.local) < c.replicas and c.busy
                    and self.hold_for_faster(request, replica, c.busy, c.queued)):
                return None
            return replica
        if c.peers:
            return self.pick_peer(request, c.peers)
        if request.may_forward and c.reachable:
            return self.forward_queued(request, c.now, c.reachable)
        return None

    def pick_replica(self, request: Request, candidates: Sequence[ReplicaState]) -> ReplicaState:
        """Choose one of ``candidates`` (non-empty) for ``request``; default: the least loaded."""
        return self.least_loaded(candidates)

    def pick_peer(self, request: Request, candidates: Sequence[PeerState]) -> PeerState:
        """Choose one of ``candidates`` (non-empty, all available peers) for ``request``; default: most room."""
        return scoring.most_room(candidates)

    def routed(self, request: Request, *, replica: str | None = None, peer: str | None = None) -> None:
        """Learn from a decision: ``request`` went to local replica ``replica`` or to peer region ``peer``."""

    def set_members(self, replicas: Iterable[str], peers: Iterable[str]) -> None:
        """The current local replica ids and peer regions (members that left are forgotten)."""

    def replica_unavailable_reason(self, replica: ReplicaState) -> str | None:
        """A policy's own availability clause beyond ``AvailabilityRules`` (None: no objection), a short phrase."""
        return None

    def uncached_tokens(self, request: Request, replica_id: str) -> int:
        """Prompt tokens of ``request`` the replica ``replica_id`` is expected to prefill (not find cached);
        default: the whole prompt (skylb/core/estimate.py ``prompt_tokens``)."""
        return prompt_tokens(request)

    def advertised(self, available: Sequence[ReplicaState], replicas: Sequence[ReplicaState]) -> dict:
        """Extra PeerStatus fields this policy tells peers (``available``: local replicas with room now,
        ``replicas``: all, draining excluded); default: none."""
        return {}

    def estimated_wait_s(self, replica: ReplicaState) -> float | None:
        """Seconds a new request would wait before its prefill starts on ``replica``; None: no estimate."""
        return None

    def prefer_peer(self, request: Request, replica: ReplicaState,
                    peers: Sequence[PeerState]) -> PeerState | None:
        """A peer to forward ``request`` to although local ``replica`` (already picked) could take it, or None
        (the default: a local replica with room always wins, the paper's rule)."""
        return None

    def hold_for_faster(self, request: Request, replica: ReplicaState, busy: Sequence[ReplicaState],
                        queued: int) -> bool:
        """True to keep ``request`` queued although ``replica`` (already picked) could take it now, because one of
        ``busy`` (usable replicas serving its model, full now) would finish it sooner; ``queued``: requests in this
        balancer's queue, ``request`` included. Default: False (a replica with room always takes the request)."""
        return False

    def next_in_queue(self, window: Sequence[Request], local: Sequence[ReplicaState], peers: Sequence[PeerState],
                      replicas: Sequence[ReplicaState]) -> int:
        """Index in ``window`` (the first ``queue_lookahead`` queued requests) of the one to place next, given the
        local replicas with room (``local``), the available peers (``peers``) and every local replica
        (``replicas``); default: 0, the head (first come, first served)."""
        return 0

    def forward_queued(self, request: Request, now: float, peers: Sequence[PeerState]) -> PeerState | None:
        """A peer to forward ``request`` to although neither a local replica nor a peer has room now (``peers``:
        healthy ones serving its model, none available), or None: it waits here (the default, the paper's rule)."""
        return None

    def least_loaded(self, candidates: Sequence[ReplicaState]) -> ReplicaState:
        """Fewest outstanding requests from this balancer, ties rotated so idle replicas share the load."""
        return scoring.least_loaded(candidates, next(self._rotation))


def policy_names() -> list[str]:
    """Every registered policy name, sorted (the choices of the ``policy`` setting and ``--policy``)."""
    return sorted(POLICIES)


def _policy_class(name: str) -> type[Policy]:
    try:
        return POLICIES[name]
    except KeyError:
        raise PolicyError(f"unknown policy {name!r}; known: {', '.join(policy_names())}") from None


def options_class(name: str) -> type:
    """The Options dataclass of policy ``name``; raises PolicyError for an unknown name."""
    return _policy_class(name).Options


def policy_options(name: str, options: Mapping[str, Any] | None = None) -> Any:
    """Validate ``options`` for policy ``name`` into its Options instance.

    Raises PolicyError naming the policy, the offending options and the ones it declares.
    """
    cls = options_class(name)
    try:
        return cls(**dict(options or {}))
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'options'}: {e['msg']}" for e in exc.errors())
        known = ", ".join(cls.__dataclass_fields__) or "none"
        raise PolicyError(f"policy {name!r}: {problems} (its options: {known})") from None


def make_policy(name: str, **options: Any) -> Policy:
    """Build the policy registered as ``name`` with ``options``; raises PolicyError on an unknown name or option."""
    return _policy_class(name)(policy_options(name, options))
