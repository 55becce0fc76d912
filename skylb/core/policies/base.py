"""The policy registry and typed options: a named policy is a function from its options to a Profile.

Each policy module declares its options as a frozen pydantic dataclass (unknown and ill-typed options are errors, so
a misspelt setting never falls back to a default silently) and registers a builder that composes plugins into a
Profile (skylb/core/profile.py; SkyServe's registry pattern):

    register("least-load", NoOptions, lambda options: Profile(...))
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass as plain_dataclass
from typing import Any

from pydantic import ConfigDict, ValidationError
from pydantic.dataclasses import dataclass

from skylb.core.profile import Profile

__all__ = ["POLICIES", "PolicyError", "PolicySpec", "NoOptions", "OPTIONS_CONFIG", "register", "make_policy",
           "policy_options", "policy_names", "options_class"]

#: What every policy's Options dataclass is declared with: frozen, unknown keys rejected.
OPTIONS_CONFIG = ConfigDict(extra="forbid")


class PolicyError(ValueError):
    """An unknown policy name, or options a policy does not declare or that fail its validation."""


@dataclass(frozen=True, config=OPTIONS_CONFIG)
class NoOptions:
    """Options of a policy that has none."""


@plain_dataclass(frozen=True)
class PolicySpec:
    """A registered policy: its name, its Options dataclass and the builder of its Profile."""

    name: str
    Options: type
    build: Callable[[Any], Profile]


#: name -> PolicySpec, filled by ``register``.
POLICIES: dict[str, PolicySpec] = {}


def register(name: str, options: type, build: Callable[[Any], Profile]) -> PolicySpec:
    """Register policy ``name`` (one spelling: lower case, words joined by '-') with its Options dataclass and its
    Profile builder; raises ValueError for a badly spelt or already registered name."""
    if name != name.lower() or "_" in name or " " in name:
        raise ValueError(f"policy name {name!r}: lower case, words joined by '-'")
    if name in POLICIES:
        raise ValueError(f"policy {name!r} is registered already")
    POLICIES[name] = spec = PolicySpec(name, options, build)
    return spec


def policy_names() -> list[str]:
    """Every registered policy name, sorted (the choices of the ``policy`` setting and ``--policy``)."""
    return sorted(POLICIES)


def _spec(name: str) -> PolicySpec:
    try:
        return POLICIES[name]
    except KeyError:
        raise PolicyError(f"unknown policy {name!r}; known: {', '.join(policy_names())}") from None


def options_class(name: str) -> type:
    """The Options dataclass of policy ``name``; raises PolicyError for an unknown name."""
    return _spec(name).Options


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


def make_policy(name: str, **options: Any) -> Profile:
    """The Profile of policy ``name`` built with ``options``; raises PolicyError on an unknown name or option."""
    return _spec(name).build(policy_options(name, options))
