"""The one translation from settings to routing-core objects, used by the balancer, the simulator and benchmarks.

``build_router(region, settings)`` is the only place that turns a balancer's settings (``skylb.config.
BalancerConfig``, or any object with the same attributes) into a ``Router``: the policy by registry name with its
validated options, and the availability rules. So the simulated SkyLB and the live balancer built from the same
config route with equal routers (tests/test_builder.py), and a setting cannot be passed in one place and forgotten
in another.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from skylb.core.fleet_rules import FleetRules, FleetSettings
from skylb.core.kv_index import BlockIndex
from skylb.core.outlier import OutlierDetector
from skylb.core.policies import make_policy
from skylb.core.profile import Profile
from skylb.core.router import Router
from skylb.core.state import AvailabilityRules

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = ["RouterSettings", "OutlierSettings", "QueueClassSettings", "build_router", "build_policy", "build_rules"]


class OutlierSettings(Protocol):
    """Passive health checking's settings (skylb.config.OutlierDetection has all of them; Envoy's
    ``outlier_detection`` names and units): consecutive_5xx and consecutive_gateway_failure, counts (0: off);
    base_ejection_time_s, max_ejection_time_s and interval_s, seconds; max_ejection_percent and
    healthy_panic_threshold, percent."""

    consecutive_5xx: int
    consecutive_gateway_failure: int
    base_ejection_time_s: float
    max_ejection_time_s: float
    interval_s: float
    max_ejection_percent: float
    healthy_panic_threshold: float


class QueueClassSettings(Protocol):
    """Priority classes in the queue (the balancer's ``priorities`` section has both): ``enabled`` (False: one
    first-come-first-served queue), ``aging_s`` (seconds a waiting request takes to climb one class)."""

    enabled: bool
    aging_s: float


class RouterSettings(Protocol):
    """What the builder reads from a balancer's settings (skylb.config.BalancerConfig has all of it).

    Attributes:
        policy: a registered policy name. policies: per policy name, its options (validated by the policy).
        probe_interval_ms: probe period, ms. stale_after_intervals: a probe older than this many intervals is
        stale. peer_stale_after_intervals: the same for a peer's status when sooner (0: stale_after_intervals
        alone). tau: the longest peer queue that keeps a peer available. max_dispatch_per_probe: optional ceiling
        between two probes (0: none). learn_capacity: learn each replica's admission capacity
        (skylb/core/capacity.py). pending_allowance: requests allowed to wait in a replica's queue beyond it
        (None: the policy's own). max_queue: the most requests the queue holds. outlier_detection: when a failing
        replica or peer is ejected. ollama_fleet: the Ollama fleet rules (all off by default). priorities:
        priority classes in the queue.
    """

    policy: str
    policies: "Mapping[str, Mapping[str, Any]]"
    probe_interval_ms: float
    stale_after_intervals: float
    peer_stale_after_intervals: float
    tau: int
    max_dispatch_per_probe: int
    learn_capacity: bool
    pending_allowance: int | None
    max_queue: int
    outlier_detection: OutlierSettings
    ollama_fleet: FleetSettings
    priorities: QueueClassSettings


def build_policy(settings: RouterSettings) -> Profile:
    """The policy ``settings.policy`` with its options from ``settings.policies``; raises PolicyError if invalid."""
    return make_policy(settings.policy, **dict(settings.policies.get(settings.policy, {})))


def build_rules(settings: RouterSettings, policy: Profile | None = None) -> AvailabilityRules:
    """The availability rules: tau, staleness (``stale_after_intervals`` probe intervals, s; for peers
    ``peer_stale_after_intervals`` when sooner), the learned admission capacity and the dispatch ceiling.
    ``settings.pending_allowance`` None takes ``policy``'s own (the policy ``settings.policy`` names when None is
    given; raises PolicyError if that is invalid)."""
    interval_s = settings.probe_interval_ms / 1000
    allowance = settings.pending_allowance
    if allowance is None:
        allowance = (policy if policy is not None else build_policy(settings)).pending_allowance
    return AvailabilityRules(tau=settings.tau, stale_after_s=interval_s * settings.stale_after_intervals,
                             max_dispatch_per_probe=settings.max_dispatch_per_probe,
                             learn_capacity=settings.learn_capacity, pending_allowance=allowance,
                             peer_stale_after_s=interval_s * settings.peer_stale_after_intervals)


def build_router(region: str, settings: RouterSettings, *, max_queue: int | None = None,
                 kv_index: BlockIndex | None = None) -> Router:
    """A Router for ``region`` from ``settings``; ``max_queue`` overrides ``settings.max_queue`` (the simulator
    never refuses a request, so it passes a bound no run reaches); ``kv_index``: the block index of the engines'
    KV-cache events, given to the policy's plugins that price cache locality (None: the prefix trie alone).
    Raises PolicyError on an invalid policy."""
    priorities = settings.priorities
    policy = build_policy(settings)
    if kv_index is not None:
        policy.attach_kv_index(kv_index)
    return Router(region=region, policy=policy, rules=build_rules(settings, policy),
                  max_queue=settings.max_queue if max_queue is None else max_queue,
                  outlier=OutlierDetector.from_settings(settings.outlier_detection),
                  fleet=FleetRules(settings.ollama_fleet),
                  priorities=priorities.enabled, aging_s=priorities.aging_s if priorities.enabled else 0.0)
