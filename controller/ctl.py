"""skylb-ctl: the operator's command line for the SkyLB controller (add, remove and list replicas and balancers;
the whole system's status at a glance).

Exit status: 0 on success, 1 when the controller refused the request or could not be reached (one line on stderr
says why), 2 for a usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import requests
from tabulate import tabulate

from controller.store import ENGINES, InvalidInput, normalize_url

__all__ = ["DEFAULT_CONTROLLER", "CtlError", "build_parser", "main", "system_status"]

#: Where the controller is when neither --controller nor $SKYLB_CONTROLLER says otherwise.
DEFAULT_CONTROLLER = "http://127.0.0.1:8470"

_EXAMPLES = """\
examples:
  skylb-ctl replica add --region us --url http://10.0.0.5:8000 --engine vllm
  skylb-ctl replica list --region us
  skylb-ctl replica remove us-1
  skylb-ctl replica remove --url http://10.0.0.5:8000
  skylb-ctl balancer list
  skylb-ctl membership --json
  skylb-ctl status
"""


class CtlError(Exception):
    """An expected failure: printed as one line on stderr, exit status ``status``."""

    def __init__(self, message: str, status: int = 1):
        super().__init__(message)
        self.status = status


class _Api:
    """Blocking JSON calls to the controller; every failure becomes a CtlError with a one-line message."""

    def __init__(self, base_url: str, timeout_s: float):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s

    def call(self, method: str, path: str, **kwargs: Any) -> dict:
        url = self.base_url + path
        try:
            resp = requests.request(method, url, timeout=self.timeout_s, **kwargs)
        except (requests.exceptions.MissingSchema, requests.exceptions.InvalidSchema,
                requests.exceptions.InvalidURL) as exc:
            raise CtlError(f"--controller {self.base_url!r} is not an http:// URL ({exc})", status=2) from None
        except requests.RequestException as exc:
            raise CtlError(f"cannot reach the controller at {self.base_url}: {_reason(exc)}") from None
        try:
            body = resp.json()
        except ValueError:
            body = None
        if resp.status_code >= 400:
            error = body.get("error") if isinstance(body, dict) else None
            if isinstance(error, dict) and error.get("message"):
                raise CtlError(str(error["message"]))
            raise CtlError(f"the controller at {self.base_url} answered HTTP {resp.status_code}: "
                           f"{resp.text[:200].strip()}")
        if not isinstance(body, dict):
            raise CtlError(f"the controller at {self.base_url} answered something that is not JSON: "
                           f"{resp.text[:200].strip()!r}")
        return body


def _reason(exc: requests.RequestException) -> str:
    # requests nests the interesting part (e.g. "Connection refused") deep inside urllib3's wrapper messages.
    if isinstance(exc, requests.Timeout):
        return "timed out"
    inner: BaseException | None = exc
    while inner is not None and inner.__context__ is not None and not isinstance(inner, ConnectionRefusedError):
        inner = inner.__context__
    if isinstance(inner, ConnectionRefusedError):
        return "connection refused"
    return str(exc).splitlines()[0][:200]


# --- commands ---------------------------------------------------------------------------------------------------

def _replica_add(api: _Api, args: argparse.Namespace) -> None:
    body = {"region": args.region, "url": args.url, "engine": args.engine}
    if args.id:
        body["id"] = args.id
    if args.max_concurrency is not None:
        body["max_concurrency"] = args.max_concurrency
    r = api.call("POST", "/v1/replicas", json=body)
    if args.json:
        _print_json(r)
    else:
        print(f"added replica {r['id']} (region {r['region']}, {r['engine']} at {r['url']})")


def _replica_remove(api: _Api, args: argparse.Namespace) -> None:
    replica_id = args.id
    if args.url:
        try:
            url = normalize_url(args.url)
        except InvalidInput as exc:
            raise CtlError(str(exc), status=2) from None
        matches = [r for r in api.call("GET", "/v1/replicas")["replicas"] if r["url"] == url]
        if not matches:
            raise CtlError(f"url: no replica has URL {url}")
        replica_id = matches[0]["id"]
    r = api.call("DELETE", f"/v1/replicas/{requests.utils.quote(replica_id, safe='')}")
    if args.json:
        _print_json(r)
    else:
        print(f"removed replica {r['id']} (region {r['region']}, {r['engine']} at {r['url']})")


def _replica_list(api: _Api, args: argparse.Namespace) -> None:
    params = {"region": args.region} if args.region else {}
    replicas = api.call("GET", "/v1/replicas", params=params)["replicas"]
    if args.json:
        _print_json(replicas)
    else:
        print(_replica_table(replicas))


def _balancer_list(api: _Api, args: argparse.Namespace) -> None:
    balancers = api.call("GET", "/v1/balancers")["balancers"]
    if args.json:
        _print_json(balancers)
    else:
        print(_balancer_table(balancers))


def _membership(api: _Api, args: argparse.Namespace) -> None:
    m = api.call("GET", "/v1/membership")
    if args.json:
        _print_json(m)
        return
    print(f"revision: {m['revision']}")
    print(f"regions: {', '.join(m['regions']) or '(none)'}")
    print(f"\nbalancers:\n{_balancer_table(m['balancers'])}")
    print(f"\nreplicas:\n{_replica_table(m['replicas'])}")


def _replica_table(replicas: list[dict]) -> str:
    if not replicas:
        return "(no replicas)"
    rows = [(r["id"], r["region"], r["engine"], r["url"],
             "-" if r.get("max_concurrency") is None else r["max_concurrency"],
             "yes" if r.get("healthy", True) else "NO") for r in replicas]
    return tabulate(rows, headers=["ID", "REGION", "ENGINE", "URL", "MAX CONCURRENCY", "HEALTHY"])


def _balancer_status(url: str, timeout_s: float) -> tuple[dict | None, str | None]:
    """A balancer's operator status (``/skylb/v1/status?format=json``), or None and why it could not be read."""
    headers = {"X-SkyLB-Token": os.environ["SKYLB_PEER_TOKEN"]} if os.environ.get("SKYLB_PEER_TOKEN") else {}
    try:
        resp = requests.get(f"{url.rstrip('/')}/skylb/v1/status", params={"format": "json"}, headers=headers,
                            timeout=timeout_s)
        resp.raise_for_status()
        return resp.json(), None
    except (requests.RequestException, ValueError) as exc:
        return None, _reason(exc) if isinstance(exc, requests.RequestException) else "not JSON"


def system_status(membership: dict, statuses: dict[str, tuple[dict | None, str | None]]) -> dict:
    """The whole system from the controller's ``membership`` and each balancer's status (by URL): ``{"revision",
    "balancers": [{"region", "url", "reachable", "error", "queue_len", "available_replicas", "forwarded"}],
    "replicas": [{"id", "region", "engine", "url", "healthy" (the controller's check), "balancer" (the URL of the
    balancer serving it, or None), "pending", "running", "outstanding", "available", "reason"}]}``; figures the
    balancer did not give are None."""
    balancers, seen = [], {}
    for b in membership.get("balancers", []):
        status, error = statuses.get(b["url"], (None, "not asked"))
        balancers.append({"region": b["region"], "url": b["url"], "reachable": status is not None, "error": error,
                          "queue_len": status.get("queue_len") if status else None,
                          "available_replicas": status.get("available_replicas") if status else None,
                          "forwarded": sum(p.get("forwarded", 0) for p in status.get("peers", [])) if status else None})
        for r in (status or {}).get("replicas", []):
            seen[r["id"]] = (b["url"], r)
    replicas = []
    for r in membership.get("replicas", []):
        url, live = seen.get(r["id"], (None, {}))
        replicas.append({"id": r["id"], "region": r["region"], "engine": r["engine"], "url": r["url"],
                         "healthy": r.get("healthy", True), "balancer": url,
                         **{k: live.get(k) for k in ("pending", "running", "outstanding", "available", "reason")}})
    return {"revision": membership.get("revision"), "balancers": balancers, "replicas": replicas}


def _status(api: _Api, args: argparse.Namespace) -> None:
    membership = api.call("GET", "/v1/membership")
    statuses = {b["url"]: _balancer_status(b["url"], min(api.timeout_s, 3.0)) for b in membership["balancers"]}
    view = system_status(membership, statuses)
    if args.json:
        _print_json(view)
        return
    dash = lambda v: "-" if v is None else v  # noqa: E731
    print(f"revision {view['revision']}\n")
    print(tabulate([(b["region"], b["url"], "up" if b["reachable"] else f"DOWN ({b['error']})",
                     dash(b["available_replicas"]), dash(b["queue_len"]), dash(b["forwarded"]))
                    for b in view["balancers"]] or [("(no balancers)",)],
                   headers=["REGION", "BALANCER", "STATE", "AVAILABLE", "QUEUE", "FORWARDED"]))
    print()
    print(tabulate([(r["region"], r["id"], r["engine"], "yes" if r["healthy"] else "NO",
                     "yes" if r["available"] else (r["reason"] or "-"), dash(r["pending"]), dash(r["running"]),
                     dash(r["outstanding"]), r["url"]) for r in view["replicas"]] or [("(no replicas)",)],
                   headers=["REGION", "REPLICA", "ENGINE", "HEALTHY", "AVAILABLE", "PENDING", "RUNNING",
                            "IN FLIGHT", "URL"]))


def _balancer_table(balancers: list[dict]) -> str:
    if not balancers:
        return "(no balancers)"
    now = time.time()
    rows = [(b["region"], b["url"], f"{max(0.0, now - b['last_seen']):.0f}s ago") for b in balancers]
    return tabulate(rows, headers=["REGION", "URL", "LAST SEEN"])


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=2))


# --- parser -----------------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    """The `skylb-ctl` argument parser (each command stores its function in ``args.run``)."""
    parser = argparse.ArgumentParser(
        prog="skylb-ctl", description=__doc__.splitlines()[0], epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--controller", metavar="URL", default=os.environ.get("SKYLB_CONTROLLER") or DEFAULT_CONTROLLER,
                        help=f"controller URL (default: $SKYLB_CONTROLLER, else {DEFAULT_CONTROLLER})")
    parser.add_argument("--timeout", metavar="S", type=float, default=10.0,
                        help="seconds to wait for the controller (default: 10)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    replica = sub.add_parser("replica", help="add, remove or list replicas (inference engine endpoints)",
                             description="Add, remove or list replicas (inference engine endpoints).")
    rsub = replica.add_subparsers(dest="action", metavar="ACTION", required=True)

    add = rsub.add_parser("add", help="register a replica in a region (the region is created on first use)",
                          description="Register a replica in a region; the region is created on first use.")
    add.add_argument("--region", required=True, help="region name, e.g. us")
    add.add_argument("--url", required=True, help="the engine's base URL, e.g. http://10.0.0.5:8000")
    add.add_argument("--engine", default="vllm", choices=ENGINES, metavar="ENGINE",
                     help=f"one of: {', '.join(ENGINES)}; auto detects it by probing (default: vllm)")
    add.add_argument("--max-concurrency", type=int, metavar="N",
                     help="parallel slots of an engine without a pending metric: Ollama's OLLAMA_NUM_PARALLEL, "
                          "or a generic OpenAI server's concurrency limit (default: the adapter's, 1 for ollama, "
                          "8 for openai)")
    add.add_argument("--id", help="replica id (default: <region>-<n>, chosen by the controller)")
    add.add_argument("--json", action="store_true", help="print the new replica as JSON")
    add.set_defaults(run=_replica_add)

    remove = rsub.add_parser("remove", help="unregister a replica by id or by URL",
                             description="Unregister a replica, given its id or its URL.")
    which = remove.add_mutually_exclusive_group(required=True)
    which.add_argument("id", nargs="?", help="replica id, as shown by `replica list`")
    which.add_argument("--url", help="remove the replica with this URL instead")
    remove.add_argument("--json", action="store_true", help="print the removed replica as JSON")
    remove.set_defaults(run=_replica_remove)

    lst = rsub.add_parser("list", help="list replicas", description="List replicas, sorted by region then id.")
    lst.add_argument("--region", help="only this region's replicas")
    lst.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    lst.set_defaults(run=_replica_list)

    balancer = sub.add_parser("balancer", help="list registered balancers (one or more per region)",
                              description="Show the balancers that registered with the controller.")
    bsub = balancer.add_subparsers(dest="action", metavar="ACTION", required=True)
    blst = bsub.add_parser("list", help="list balancers and when each was last seen",
                           description="List balancers and when each last sent a heartbeat.")
    blst.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    blst.set_defaults(run=_balancer_list)

    membership = sub.add_parser("membership", help="show the whole membership and its revision",
                                description="Show the whole membership (regions, balancers, replicas) "
                                            "and its revision.")
    membership.add_argument("--json", action="store_true", help="print the controller's JSON snapshot")
    membership.set_defaults(run=_membership)

    status = sub.add_parser("status", help="the whole system at a glance: balancers and replicas, live",
                            description="One view of the system: each region's balancer (reachable, available "
                                        "replicas, queue, requests forwarded) and each replica (the controller's "
                                        "health check, and from its balancer: available or why not, pending, "
                                        "running, in flight). Balancers are asked directly (their operator status "
                                        "endpoint; $SKYLB_PEER_TOKEN is sent when set).")
    status.add_argument("--json", action="store_true", help="print the view as JSON")
    status.set_defaults(run=_status)
    return parser


def _fail(message: str, status: int) -> int:
    print(f"skylb-ctl: error: {message}", file=sys.stderr)
    return status


def main(argv: list[str] | None = None) -> int:
    """Entry point of `skylb-ctl`; returns the exit status (0 ok, 1 refused or unreachable, 2 usage)."""
    args = build_parser().parse_args(argv)
    if args.timeout <= 0:
        return _fail("--timeout must be > 0", 2)
    try:
        args.run(_Api(args.controller, args.timeout), args)
    except CtlError as exc:
        return _fail(str(exc), exc.status)
    except BrokenPipeError:  # `skylb-ctl replica list | head`: the reader left; not an error worth a traceback
        sys.stderr.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
