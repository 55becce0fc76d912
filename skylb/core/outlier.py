"""Outlier detection (passive health checking) with Envoy's names and defaults.

Source: Envoy's ``outlier_detection`` (Envoy docs, architecture overview: "Outlier detection" and "Panic threshold"; API
reference ``config.cluster.v3.OutlierDetection``). A target (a local replica or a peer balancer) that fails
``consecutive_5xx`` requests in a row, or ``consecutive_gateway_failure`` of them with a gateway failure (refused,
reset, timed out before the first byte, 502/503/504), is ejected for ``base_ejection_time_s`` x its ejection count (at
most ``max_ejection_time_s``); the count drops by one for every ``interval_s`` spent un-ejected. At most
``max_ejection_percent`` of a population (the local replicas; the peers) is ejected at once, rounded down but at least
one target, as Envoy ejects at least one host whatever the percentage. When fewer than ``healthy_panic_threshold``
percent of a population is healthy and un-ejected, ejection is ignored for it (panic): routing to a possibly bad target
beats routing nowhere.

Pure: no clock, no I/O; times are arguments (s).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

__all__ = ["OutlierDetector", "Ejectable"]


class Ejectable(Protocol):
    """What the detector reads and writes on a target (ReplicaState and PeerState have these fields)."""

    healthy: bool
    gateway_failures: int
    consecutive_5xx: int
    ejections: int
    ejected_until: float | None


@dataclass
class OutlierDetector:
    """The ejection rules; one instance per router, applied to replicas and peers as two populations.

    Args (Envoy's names): consecutive_5xx, consecutive_gateway_failure (0: never on that count);
    base_ejection_time_s, max_ejection_time_s, interval_s (s); max_ejection_percent, healthy_panic_threshold (%).
    """

    consecutive_5xx: int = 5
    consecutive_gateway_failure: int = 5
    base_ejection_time_s: float = 30.0
    max_ejection_time_s: float = 300.0
    interval_s: float = 10.0
    max_ejection_percent: float = 10.0
    healthy_panic_threshold: float = 50.0

    @classmethod
    def from_settings(cls, settings: object | None) -> "OutlierDetector":
        """From a config's ``outlier_detection`` section (skylb.config.OutlierDetection) or defaults for None."""
        if settings is None:
            return cls()
        return cls(**{name: getattr(settings, name) for name in cls.__dataclass_fields__})

    @staticmethod
    def is_ejected(target: Ejectable, now: float) -> bool:
        """True while ``target``'s ejection lasts at ``now``."""
        return target.ejected_until is not None and now < target.ejected_until

    def failed(self, target: Ejectable, population: Iterable[Ejectable], *, now: float, gateway: bool) -> bool:
        """``target`` failed a request at ``now`` (``gateway``: a gateway failure; else another 5xx). Counts it and
        ejects the target when a consecutive count is reached and ``max_ejection_percent`` of ``population`` (its
        replicas or its peers, itself included) allows; returns True when it was ejected now."""
        target.consecutive_5xx += 1
        if gateway:
            target.gateway_failures += 1
        due = ((self.consecutive_5xx and target.consecutive_5xx >= self.consecutive_5xx)
               or (gateway and self.consecutive_gateway_failure
                   and target.gateway_failures >= self.consecutive_gateway_failure))
        if not due or self.is_ejected(target, now):
            return False
        members = list(population)
        ejected = sum(1 for t in members if self.is_ejected(t, now))
        if ejected >= self.max_ejectable(len(members)):
            return False  # Envoy too keeps counting and ejects only when the percentage allows
        if target.ejected_until is not None:  # the count decays by one per interval spent un-ejected
            target.ejections = max(0, target.ejections - int((now - target.ejected_until) // self.interval_s))
        target.ejections += 1
        target.ejected_until = now + min(self.base_ejection_time_s * target.ejections, self.max_ejection_time_s)
        target.consecutive_5xx = target.gateway_failures = 0
        return True

    @staticmethod
    def answered(target: Ejectable) -> None:
        """``target`` answered a request without a 5xx: its runs of failures are over."""
        target.consecutive_5xx = target.gateway_failures = 0

    def max_ejectable(self, members: int) -> int:
        """How many of ``members`` targets may be ejected at once: ``max_ejection_percent`` rounded down, at least 1."""
        return max(1, math.floor(members * self.max_ejection_percent / 100.0 + 1e-9))

    def panic(self, population: Iterable[Ejectable], now: float) -> bool:
        """True when fewer than ``healthy_panic_threshold`` percent of ``population`` is healthy and un-ejected:
        ejection is then ignored for it (an empty population is not in panic)."""
        members = list(population)
        if not members or not self.healthy_panic_threshold:
            return False
        usable = sum(1 for t in members if t.healthy and not self.is_ejected(t, now))
        return usable * 100.0 < self.healthy_panic_threshold * len(members)
