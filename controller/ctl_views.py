"""What skylb-ctl prints: the whole system's status (the controller's membership joined with each balancer's own
status) and the tables of replicas, balancers and quotas."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from tabulate import tabulate

from skylb.environment import PEER_TOKEN, env

if TYPE_CHECKING:  # requests loads where a balancer is asked (skylb-ctl), not in the controller that shows the page
    import requests

__all__ = ["balancer_status", "Refused", "PEER_TOKEN_HOW", "request_error",
           "system_status", "status_tables", "replica_table", "balancer_table",
           "quota_tables"]


def request_error(exc: requests.RequestException) -> str:
    """A one-line reason for a failed HTTP call ("connection refused", "timed out", or the first line)."""
    import requests
    # requests nests the interesting part (e.g. "Connection refused") deep inside urllib3's wrapper messages.
    if isinstance(exc, requests.Timeout):
        return "timed out"
    inner: BaseException | None = exc
    while inner is not None and inner.__context__ is not None and not isinstance(inner, ConnectionRefusedError):
        inner = inner.__context__
    if isinstance(inner, ConnectionRefusedError):
        return "connection refused"
    return str(exc).splitlines()[0][:200]


class Refused(str):
    """Why a balancer that answered would not give its status (a 401 or 403: the peer token is missing or wrong)."""


#: How skylb-ctl is given the peer token (said when a balancer refuses for want of it).
PEER_TOKEN_HOW = f"set ${PEER_TOKEN.name} or pass --peer-token-file FILE"


def balancer_status(url: str, timeout_s: float, token: str | None = None) -> tuple[dict | None, str | None]:
    """A balancer's operator status (``/skylb/v1/status?format=json``), or None and why it could not be read: a
    ``Refused`` when the balancer answered 401 or 403 (the peer token missing or wrong), else a plain str (down).

    ``token`` (default ``$SKYLB_PEER_TOKEN``) is sent as the peer token when set.
    """
    import requests
    token = token or env(PEER_TOKEN)
    headers = {"X-SkyLB-Token": token} if token else {}
    try:
        resp = requests.get(f"{url.rstrip('/')}/skylb/v1/status", params={"format": "json"}, headers=headers,
                            timeout=timeout_s)
        if resp.status_code in (401, 403):
            return None, Refused(f"refused: wrong peer token ({PEER_TOKEN_HOW} with the balancers' token)" if token
                                 else f"refused: the status needs the peer token ({PEER_TOKEN_HOW})")
        resp.raise_for_status()
        return resp.json(), None
    except requests.RequestException as exc:
        return None, request_error(exc)
    except ValueError:
        return None, "not JSON"


def _state(status: dict | None, error: str | None) -> str:
    if status is not None:
        return "up"
    return "refused" if isinstance(error, Refused) else "down"


def system_status(membership: dict, statuses: dict[str, tuple[dict | None, str | None]]) -> dict:
    """The whole system from the controller's ``membership`` and each balancer's status (by URL).

    Shape: ``{"revision", "regions": [{"region", "balancer_region" (whose balancer serves its replicas), "epoch"}],
    "balancers": [{"region", "url", "healthy" (the controller's check), "draining", "state" ("up"; "refused": it
    answered but wants the peer token; "down": no answer), "reachable" (it answered: up or refused), "error",
    "queue_len", "in_flight", "available_replicas", "forwarded", "forwarded_per_s", "serves" ({region: epoch}),
    "placed_by_rule" ({rule: placements since its start})}],
    "replicas": [{"id", "region", "engine", "url", "healthy" (the controller's check), "draining", "balancer" (the
    URL of its owner when a balancer's status lists it, else None), "pending", "running", "outstanding",
    "available", "reason"}]}``;
    figures a balancer did not give are None.
    """
    balancers, seen = [], {}
    for b in membership.get("balancers", []):
        status, error = statuses.get(b["url"], (None, "not asked"))
        live = status or {}
        balancers.append({
            "region": b["region"], "url": b["url"], "healthy": b.get("healthy", True),
            "draining": b.get("draining", False), "state": _state(status, error),
            "reachable": _state(status, error) != "down", "error": error and str(error),
            **{k: live.get(k) for k in ("queue_len", "in_flight", "available_replicas", "forwarded_per_s")},
            "forwarded": sum(p.get("forwarded", 0) for p in live.get("peers", [])) if status else None,
            "serves": live.get("served_regions"), "placed_by_rule": live.get("placed_by_rule")})
        for r in live.get("replicas", []):
            seen[r["id"]] = (b["url"], r)
    replicas = []
    owners = {o["replica"]: o["balancer"] for o in membership.get("owners", [])}
    for r in membership.get("replicas", []):
        url, live = seen.get(r["id"], (None, {}))
        if url is not None:  # listed by a balancer: its owner's, not a sibling's still draining it
            url = owners.get(r["id"], url)
        replicas.append({"id": r["id"], "region": r["region"], "engine": r["engine"], "url": r["url"],
                         "healthy": r.get("healthy", True), "draining": r.get("draining", False), "balancer": url,
                         **{k: live.get(k) for k in ("pending", "running", "outstanding", "available", "reason")}})
    regions = [{"region": a["region"], "balancer_region": a["balancer_region"], "epoch": a["epoch"]}
               for a in membership.get("assignments", [])]
    return {"revision": membership.get("revision"), "regions": regions, "balancers": balancers,
            "replicas": replicas}


def _dash(value: Any) -> Any:
    return "-" if value is None else value


def _yes(flag: bool) -> str:
    return "yes" if flag else "NO"


def status_tables(view: dict) -> str:
    """``system_status``'s view as text: regions (who serves them), balancers, replicas, and each balancer's
    placements by the routing profile's plugin that made them (``X-SkyLB-Rule``) when any balancer reports them."""
    regions = tabulate([(r["region"], r["balancer_region"] + ("" if r["balancer_region"] == r["region"]
                                                               else "  (failed over)"), r["epoch"])
                        for r in view["regions"]] or [("(no regions)",)],
                       headers=["REGION", "SERVED BY", "EPOCH"])
    balancers = tabulate(
        [(b["region"], b["url"], _yes(b["healthy"]), "yes" if b["draining"] else "no",
          {"up": "up", "refused": f"REFUSED ({b['error']})"}.get(b["state"], f"DOWN ({b['error']})"),
          ",".join(sorted(b["serves"])) if b["serves"] else "-", _dash(b["available_replicas"]),
          _dash(b["queue_len"]), _dash(b["in_flight"]), _dash(b["forwarded"]), _dash(b["forwarded_per_s"]))
         for b in view["balancers"]] or [("(no balancers)",)],
        headers=["REGION", "BALANCER", "HEALTHY", "DRAINING", "STATE", "SERVES", "AVAILABLE", "QUEUE", "IN FLIGHT",
                 "FORWARDED", "FWD/S"])
    region_of = {b["url"]: b["region"] for b in view["balancers"]}
    replicas = tabulate(
        [(r["region"], r["id"], r["engine"], _yes(r["healthy"]), "yes" if r["draining"] else "no",
          region_of.get(r["balancer"], "-"), "yes" if r["available"] else (r["reason"] or "-"), _dash(r["pending"]),
          _dash(r["running"]), _dash(r["outstanding"]), r["url"]) for r in view["replicas"]] or [("(no replicas)",)],
        headers=["REGION", "REPLICA", "ENGINE", "HEALTHY", "DRAINING", "SERVED BY", "AVAILABLE", "PENDING", "RUNNING",
                 "IN FLIGHT", "URL"])
    text = f"revision {view['revision']}\n\n{regions}\n\n{balancers}\n\n{replicas}"
    placed = [(b["region"], rule, n) for b in view["balancers"]
              for rule, n in sorted((b.get("placed_by_rule") or {}).items(), key=lambda kv: -kv[1])]
    if placed:
        text += "\n\n" + tabulate(placed, headers=["REGION", "RULE (X-SkyLB-Rule)", "PLACEMENTS"])
    return text


def replica_table(replicas: list[dict]) -> str:
    """Replicas as listed by the controller (id, region, engine, URL, slots, health, drain)."""
    if not replicas:
        return "(no replicas)"
    rows = [(r["id"], r["region"], r["engine"], r["url"],
             "-" if r.get("max_concurrency") is None else r["max_concurrency"],
             _yes(r.get("healthy", True)), "yes" if r.get("draining") else "no") for r in replicas]
    return tabulate(rows, headers=["ID", "REGION", "ENGINE", "URL", "MAX CONCURRENCY", "HEALTHY", "DRAINING"])


def balancer_table(balancers: list[dict], assignments: list[dict] | None = None) -> str:
    """Registered balancers (region, URL, last heartbeat, health, drain, the regions whose replicas it serves)."""
    if not balancers:
        return "(no balancers)"
    now = time.time()
    serves: dict[str, list[str]] = {}
    for a in assignments or []:
        serves.setdefault(a["balancer_region"], []).append(f"{a['region']}@{a['epoch']}")
    rows = [(b["region"], b["url"], f"{max(0.0, now - b['last_seen']):.0f}s ago", _yes(b.get("healthy", True)),
             "yes" if b.get("draining") else "no", ",".join(serves.get(b["region"], [])) or "-") for b in balancers]
    return tabulate(rows, headers=["REGION", "URL", "LAST SEEN", "HEALTHY", "DRAINING", "SERVES (REGION@EPOCH)"])


def quota_tables(body: dict) -> str:
    """``GET /v1/quotas``'s answer as text: tenants (weight, class, one row per limit), models' limits, groups."""
    quotas = body.get("quotas")
    if quotas is None:
        return "(none: the controller holds no quotas; balancers use their config's)"

    def cells(limit: dict) -> tuple:
        return tuple(_dash(limit.get(f)) for f in ("tokens_per_minute", "requests_per_minute", "max_concurrent"))

    limit_headers = ["TOKENS/MIN", "REQUESTS/MIN", "MAX CONCURRENT"]
    tenants = [(name, t.get("weight", 1.0), t.get("priority", "normal"), model, *cells(limit))
               for name, t in sorted(quotas.get("tenants", {}).items())
               for model, limit in (sorted(t.get("limits", {}).items()) or [("-", {})])]
    models = [(name, *cells(limit)) for name, limit in sorted(quotas.get("models", {}).items())]
    groups = [(name, ", ".join(f"{m}={w:g}" for m, w in members.items()))
              for name, members in sorted(quotas.get("groups", {}).items())]
    return "\n\n".join([
        f"revision {body.get('revision')}",
        tabulate(tenants, headers=["TENANT", "WEIGHT", "PRIORITY", "MODEL", *limit_headers]) if tenants
        else "(no tenant quotas)",
        tabulate(models, headers=["MODEL", *limit_headers]) if models else "(no model limits)",
        tabulate(groups, headers=["GROUP", "MEMBERS (MODEL=WEIGHT)"]) if groups else "(no model groups)"])
