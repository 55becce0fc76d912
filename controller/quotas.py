"""Edits of the controller's quota document (skylb/quota/limits.py ``Quotas``): one entry at a time, validated.

The controller holds at most one ``Quotas`` document (None until the first ``skylb-ctl quota set``: the balancers
keep their config's ``quotas`` meanwhile). ``POST /v1/quotas`` sets one entry and ``DELETE /v1/quotas`` removes one
(controller/server.py); the stores apply the edit inside their write transaction (``MembershipStore.change_quotas``)
so concurrent edits through several controllers never lose one another.

An entry is one of:

* a tenant: ``{"tenant": T, "weight"?, "priority"?, "model"?, "tokens_per_minute"?, "requests_per_minute"?,
  "max_concurrent"?}``. ``weight`` and ``priority`` are the tenant's; the limit fields go to the tenant's limit on
  ``model`` (default ``"*"``: all its models together).
* a model: ``{"model": M, <limit fields>}``: the model's own limit, whatever the tenant.
* a group: ``{"group": G, "members": {model: weight}}``: replaces the group's members.

Setting merges: a field left out keeps its value, a limit field given as null removes that limit (and a limit left
with no field is removed). Every result is validated by pydantic (``Quotas.model_validate``) before it is stored;
a bad value is InvalidInput naming the field.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError

from controller.store import InvalidInput, NotFound
from skylb.core.request import PRIORITIES
from skylb.quota.limits import ALL_MODELS, Quotas

__all__ = ["LIMIT_FIELDS", "set_entry", "remove_entry", "validate_name"]

#: The fields of a Limit, as an entry names them.
LIMIT_FIELDS = ("tokens_per_minute", "requests_per_minute", "max_concurrent")

_TENANT_FIELDS = {"tenant", "model", "weight", "priority", *LIMIT_FIELDS}
_MODEL_FIELDS = {"model", *LIMIT_FIELDS}
_GROUP_FIELDS = {"group", "members"}
# Tenants and groups: the bucket keys (tenant/<t>/<m>) and the CLI need them free of '/' and spaces. Models are
# whatever engines call them ("meta-llama/Llama-3.1-8B-Instruct", "llama3:8b"), so only printable and bounded.
_NAME = re.compile(r"^[A-Za-z0-9._@:-]{1,128}$")
_MODEL = re.compile(r"^[\x21-\x7e]{1,256}$")


def validate_name(kind: str, value: object) -> str:
    """``value`` if it is a valid ``kind`` name ("tenant", "group": letters, digits, '.', '_', '@', ':', '-', 1-128;
    "model": 1-256 printable characters without spaces), else InvalidInput naming ``kind``."""
    pattern, rule = ((_MODEL, "must be 1-256 printable characters without spaces") if kind == "model" else
                     (_NAME, "must be 1-128 letters, digits, '.', '_', '@', ':' or '-'"))
    if not isinstance(value, str) or not value:
        raise InvalidInput(kind, f"required, a {kind} name")
    if not pattern.match(value):
        raise InvalidInput(kind, f"{value!r} {rule}")
    return value


def _limit_value(field: str, value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidInput(field, f"{value!r} must be a whole number above 0 (or null to remove this limit)")
    return value


def _merge_limit(limits: dict[str, Any], key: str, entry: dict[str, Any]) -> None:
    """Merge the limit fields of ``entry`` into ``limits[key]``; drop it when no field is left."""
    given = {f: _limit_value(f, entry[f]) for f in LIMIT_FIELDS if f in entry}
    if not given:
        return
    merged = {**limits.get(key, {}), **given}
    merged = {f: v for f, v in merged.items() if v is not None}
    if merged:
        limits[key] = merged
    else:
        limits.pop(key, None)


def _validated(doc: dict[str, Any]) -> Quotas:
    try:
        return Quotas.model_validate(doc)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(p) for p in error["loc"]) or "quotas"
        raise InvalidInput(where, error["msg"]) from None


def _kind(entry: dict[str, Any]) -> str:
    if "group" in entry:
        kind, allowed = "group", _GROUP_FIELDS
    elif "tenant" in entry:
        kind, allowed = "tenant", _TENANT_FIELDS
    elif "model" in entry:
        kind, allowed = "model", _MODEL_FIELDS
    else:
        raise InvalidInput("body", "names no entry: give \"tenant\", \"model\" or \"group\"")
    unknown = set(entry) - allowed
    if unknown:
        raise InvalidInput(sorted(unknown)[0], f"unknown field for a {kind} entry (expected "
                                               f"{', '.join(sorted(allowed))})")
    return kind


def set_entry(current: Quotas | None, entry: dict[str, Any]) -> Quotas:
    """``current`` (None: no quotas yet) with one entry set (this module's docstring); InvalidInput when the entry
    is malformed or the result is not a valid Quotas."""
    doc = (current or Quotas()).model_dump(exclude_none=True)
    kind = _kind(entry)
    if kind == "group":
        name = validate_name("group", entry.get("group"))
        members = entry.get("members")
        if not isinstance(members, dict) or not members:
            raise InvalidInput("members", "required, an object of model name to weight, e.g. {\"a\": 2, \"b\": 1}")
        for model, weight in members.items():
            validate_name("model", model)
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
                raise InvalidInput("members", f"weight of {model!r} must be a number above 0, not {weight!r}")
        if name in members:
            raise InvalidInput("members", f"group {name!r} cannot list itself as a model")
        doc["groups"][name] = dict(members)
    elif kind == "tenant":
        name = validate_name("tenant", entry.get("tenant"))
        tenant = doc["tenants"].setdefault(name, {})
        if "weight" in entry:
            weight = entry["weight"]
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
                raise InvalidInput("weight", f"{weight!r} must be a number above 0 (the tenant's share of the queue)")
            tenant["weight"] = weight
        if "priority" in entry:
            if entry["priority"] not in PRIORITIES:
                raise InvalidInput("priority", f"{entry['priority']!r} is not a priority class (one of: "
                                               f"{', '.join(PRIORITIES)})")
            tenant["priority"] = entry["priority"]
        model = ALL_MODELS if entry.get("model") in (None, ALL_MODELS) else validate_name("model", entry["model"])
        if "model" in entry and not any(f in entry for f in LIMIT_FIELDS):
            raise InvalidInput("model", "a tenant's limit on a model needs at least one of --tokens-per-minute, "
                                        "--requests-per-minute, --max-concurrent")
        _merge_limit(tenant.setdefault("limits", {}), model, entry)
    else:
        name = validate_name("model", entry.get("model"))
        if not any(f in entry for f in LIMIT_FIELDS):
            raise InvalidInput("model", "a model entry needs at least one of tokens_per_minute, requests_per_minute, "
                                        "max_concurrent")
        _merge_limit(doc["models"], name, entry)
    return _validated(doc)


def remove_entry(current: Quotas | None, *, tenant: str | None = None, model: str | None = None,
                 group: str | None = None) -> Quotas:
    """``current`` without one entry: a tenant (with ``model``: only its limit on that model, ``"*"`` allowed), a
    model's limit, or a group. InvalidInput when the arguments name no entry or several; NotFound when it does not
    exist."""
    doc = (current or Quotas()).model_dump(exclude_none=True)
    if group is not None:
        if tenant is not None or model is not None:
            raise InvalidInput("group", "name a group alone, not with a tenant or a model")
        if doc["groups"].pop(group, None) is None:
            raise NotFound(f"group: no group {group!r}")
    elif tenant is not None:
        if tenant not in doc["tenants"]:
            raise NotFound(f"tenant: no quota for tenant {tenant!r}")
        if model is None:
            del doc["tenants"][tenant]
        elif doc["tenants"][tenant].get("limits", {}).pop(model, None) is None:
            raise NotFound(f"model: tenant {tenant!r} has no limit on {model!r}")
    elif model is not None:
        if doc["models"].pop(model, None) is None:
            raise NotFound(f"model: no limit on model {model!r}")
    else:
        raise InvalidInput("entry", "name the entry to delete: tenant (and model), model, or group")
    return _validated(doc)
