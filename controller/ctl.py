"""skylb-ctl: the operator's command line for the SkyLB controller: replicas (add, remove, drain, list), balancers
(list, drain, remove), quotas (set, list, delete), the membership, and the whole system's status at a glance.

Every command takes ``-o json`` (or ``--json``) to print JSON instead of a table or a sentence. Changes send the
admin token from ``$SKYLB_ADMIN_TOKEN`` or ``--admin-token-file`` (``Authorization: Bearer``); the balancers' status
(``status``, drains) is asked with the peer token from ``$SKYLB_PEER_TOKEN`` or ``--peer-token-file``.

Exit status: 0 success; 1 the controller refused the request or could not be reached (one line on stderr says
why); 2 a usage error; 3 a drain did not finish within ``--wait-timeout`` (the drain goes on).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Callable

import requests

from controller.ctl_views import (balancer_status, balancer_table, quota_tables, replica_table, request_error,
                                  status_tables, system_status)
from controller.store import ENGINES, InvalidInput, normalize_url
from skylb.cli import SuggestingParser
from skylb.core.request import PRIORITIES
from skylb.environment import CONTROLLER_URL, env
from skylb.tokens import ADMIN_TOKEN_ENV, ADMIN_TOKEN_FILE_ENV, read_token_file

__all__ = ["DEFAULT_CONTROLLER", "EXIT_OK", "EXIT_FAILED", "EXIT_USAGE", "EXIT_DRAIN_TIMEOUT", "CtlError",
           "build_parser", "main", "system_status"]

#: Where the controller is when neither --controller nor $SKYLB_CONTROLLER says otherwise.
DEFAULT_CONTROLLER = "http://127.0.0.1:8470"
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_DRAIN_TIMEOUT = 0, 1, 2, 3
#: Seconds between two looks at the balancers while waiting for a drain.
_POLL_S = 0.5

_EXAMPLES = """\
examples:
  skylb-ctl replica add --region us --url http://10.0.0.5:8000 --engine vllm
  skylb-ctl replica add --region us --url http://10.0.0.6:8000 --kv-events tcp://10.0.0.6:5557 \
      --kv-events-replay tcp://10.0.0.6:5558   # routes by the engine's KV-cache events
  skylb-ctl replica list --region us -o json
  skylb-ctl replica drain us-1            # no new requests; returns when its in-flight ones are done
  skylb-ctl replica remove us-1
  skylb-ctl balancer list
  skylb-ctl balancer drain us             # its replicas and clients move to the closest region; waits until empty
  skylb-ctl balancer undrain us
  skylb-ctl quota set --tenant acme --tokens-per-minute 100000 --max-concurrent 8 --weight 2 --priority high
  skylb-ctl quota set --model llama3:8b --tokens-per-minute 500000 --max-concurrent 16
  skylb-ctl quota set --group fast --member llama3:8b=2 --member qwen2.5:7b=1
  skylb-ctl quota list
  skylb-ctl quota delete --tenant acme
  skylb-ctl status
  skylb-ctl membership -o json

exit status: 0 ok, 1 refused or unreachable, 2 usage error, 3 drain not finished within --wait-timeout
"""


class CtlError(Exception):
    """An expected failure: printed as one line on stderr, exit status ``status``."""

    def __init__(self, message: str, status: int = EXIT_FAILED):
        super().__init__(message)
        self.status = status


class _Api:
    """Blocking JSON calls to the controller; every failure becomes a CtlError with a one-line message."""

    def __init__(self, base_url: str, timeout_s: float, admin_token: str | None = None,
                 peer_token: str | None = None):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        #: Sent to the balancers for their status (None: $SKYLB_PEER_TOKEN, if set).
        self.peer_token = peer_token
        self.headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}

    def call(self, method: str, path: str, **kwargs: Any) -> dict:
        url = self.base_url + path
        try:
            resp = requests.request(method, url, timeout=self.timeout_s, headers=self.headers, **kwargs)
        except (requests.exceptions.MissingSchema, requests.exceptions.InvalidSchema,
                requests.exceptions.InvalidURL) as exc:
            raise CtlError(f"--controller {self.base_url!r} is not an http:// URL ({exc})", EXIT_USAGE) from None
        except requests.RequestException as exc:
            raise CtlError(f"cannot reach the controller at {self.base_url}: {request_error(exc)}") from None
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


def _quote(value: str) -> str:
    return requests.utils.quote(value, safe="")


def _emit(args: argparse.Namespace, value: Any, text: Callable[[], str]) -> None:
    """Print ``value`` as JSON with ``-o json``, else the text ``text()`` makes."""
    print(json.dumps(value, indent=2) if args.output == "json" else text())


# --- replicas -----------------------------------------------------------------------------------------------------

def _replica_add(api: _Api, args: argparse.Namespace) -> None:
    body = {"region": args.region, "url": args.url, "engine": args.engine}
    if args.id:
        body["id"] = args.id
    if args.max_concurrency is not None:
        body["max_concurrency"] = args.max_concurrency
    for field in ("kv_events", "kv_events_replay", "kv_block_size"):
        if getattr(args, field) is not None:
            body[field] = getattr(args, field)
    r = api.call("POST", "/v1/replicas", json=body)
    _emit(args, r, lambda: f"added replica {r['id']} (region {r['region']}, {r['engine']} at {r['url']})")


def _replica_id(api: _Api, args: argparse.Namespace) -> str:
    if not getattr(args, "url", None):
        return args.id
    try:
        url = normalize_url(args.url)
    except InvalidInput as exc:
        raise CtlError(str(exc), EXIT_USAGE) from None
    matches = [r for r in api.call("GET", "/v1/replicas")["replicas"] if r["url"] == url]
    if not matches:
        raise CtlError(f"url: no replica has URL {url}")
    return matches[0]["id"]


def _replica_remove(api: _Api, args: argparse.Namespace) -> None:
    r = api.call("DELETE", f"/v1/replicas/{_quote(_replica_id(api, args))}")
    _emit(args, r, lambda: f"removed replica {r['id']} (region {r['region']}, {r['engine']} at {r['url']})")


def _replica_list(api: _Api, args: argparse.Namespace) -> None:
    params = {"region": args.region} if args.region else {}
    replicas = api.call("GET", "/v1/replicas", params=params)["replicas"]
    _emit(args, replicas, lambda: replica_table(replicas))


def _replica_drain(api: _Api, args: argparse.Namespace) -> None:
    replica_id = _replica_id(api, args)
    r = api.call("POST", f"/v1/replicas/{_quote(replica_id)}/drain")
    if not args.wait:
        _emit(args, {"replica": r, "done": None}, lambda: f"draining replica {replica_id}: no new requests")
        return
    revision = api.call("GET", "/v1/membership")["revision"]

    def left() -> tuple[int, list[str]]:
        """Requests still in flight on the replica, and the balancers that could not be asked or lag behind."""
        in_flight, unsure = 0, []
        for b in api.call("GET", "/v1/balancers")["balancers"]:
            status, error = balancer_status(b["url"], min(api.timeout_s, 3.0), api.peer_token)
            if status is None:
                continue  # a balancer that is down sends nothing; `status` shows it
            if (status.get("membership_revision") or 0) < revision:
                unsure.append(b["url"])
            in_flight += sum(x.get("outstanding") or 0 for x in status.get("replicas", []) if x["id"] == replica_id)
        return in_flight, unsure

    waited = _wait(args, left, f"replica {replica_id}")
    _emit(args, {"replica": r, "done": True, "waited_s": waited},
          lambda: f"replica {replica_id} drained: no requests in flight ({waited:.1f} s); "
                  f"`skylb-ctl replica remove {replica_id}` takes it out, `replica undrain` puts it back")


def _replica_undrain(api: _Api, args: argparse.Namespace) -> None:
    replica_id = _replica_id(api, args)
    r = api.call("POST", f"/v1/replicas/{_quote(replica_id)}/undrain")
    _emit(args, r, lambda: f"replica {replica_id} takes new requests again")


# --- balancers ----------------------------------------------------------------------------------------------------

def _balancer_list(api: _Api, args: argparse.Namespace) -> None:
    m = api.call("GET", "/v1/membership")
    _emit(args, m["balancers"], lambda: balancer_table(m["balancers"], m.get("assignments")))


def _balancer_drain(api: _Api, args: argparse.Namespace) -> None:
    region = args.region
    body = api.call("POST", f"/v1/regions/{_quote(region)}/drain")
    if not args.wait:
        _emit(args, {"balancers": body["balancers"], "done": None},
              lambda: f"draining region {region}'s balancers: its replicas and clients move to the closest region")
        return
    revision = api.call("GET", "/v1/membership")["revision"]

    def left() -> tuple[int, list[str]]:
        in_flight, unsure = 0, []
        for b in body["balancers"]:
            status, _ = balancer_status(b["url"], min(api.timeout_s, 3.0), api.peer_token)
            if status is None:
                continue
            if (status.get("membership_revision") or 0) < revision or not status.get("draining"):
                unsure.append(b["url"])
            in_flight += status.get("in_flight") or 0
        return in_flight, unsure

    waited = _wait(args, left, f"region {region}'s balancers")
    served_by = _serving_region(api, region)
    _emit(args, {"balancers": body["balancers"], "done": True, "waited_s": waited, "served_by": served_by},
          lambda: f"region {region}'s balancers drained: nothing queued or in flight ({waited:.1f} s); its replicas "
                  f"are served by {served_by}'s balancer; `skylb-ctl balancer undrain {region}` brings them back")


def _serving_region(api: _Api, region: str, wait_s: float = 5.0) -> str | None:
    """The region whose balancer serves ``region`` now, waiting up to ``wait_s`` s for the controller to move it
    away from its drained balancer (the move follows the drain; a busy controller makes it a moment later). After
    ``wait_s``, or at once when no other region has a healthy balancer to move to, the assignment as it stands."""
    others = [b for b in api.call("GET", "/v1/balancers")["balancers"]
              if b["region"] != region and b.get("healthy") and not b.get("draining")]
    deadline = time.monotonic() + (wait_s if others else 0.0)
    while True:
        served = {a["region"]: a["balancer_region"] for a in api.call("GET", "/v1/assignments")["assignments"]}
        if served.get(region) != region or time.monotonic() >= deadline:
            return served.get(region)
        time.sleep(0.2)


def _balancer_undrain(api: _Api, args: argparse.Namespace) -> None:
    body = api.call("POST", f"/v1/regions/{_quote(args.region)}/undrain")
    _emit(args, body["balancers"], lambda: f"region {args.region}'s balancers take clients and replicas again "
                                           f"(once healthy)")


def _balancer_remove(api: _Api, args: argparse.Namespace) -> None:
    b = api.call("DELETE", "/v1/balancers", params={"url": args.url})
    _emit(args, b, lambda: f"removed balancer {b['url']} (region {b['region']}); a running balancer registers "
                           f"again at its next heartbeat")


def _wait(args: argparse.Namespace, left: Callable[[], tuple[int, list[str]]], what: str) -> float:
    """Poll ``left()`` until nothing is in flight and every balancer has seen the drain; returns the seconds waited.
    CtlError (exit 3) after ``--wait-timeout``."""
    started = time.monotonic()
    while True:
        in_flight, unsure = left()
        if in_flight == 0 and not unsure:
            return time.monotonic() - started
        if time.monotonic() - started > args.wait_timeout:
            detail = f"{in_flight} requests still in flight" + (
                f"; not yet seen by {', '.join(unsure)}" if unsure else "")
            raise CtlError(f"{what} not drained after {args.wait_timeout:g} s: {detail} (the drain goes on)",
                           EXIT_DRAIN_TIMEOUT)
        time.sleep(_POLL_S)


# --- quotas -------------------------------------------------------------------------------------------------------

_LIMIT_OPTIONS = ("tokens_per_minute", "requests_per_minute", "max_concurrent")


def _positive_or_none(text: str) -> int | None:
    """argparse type of a limit: a whole number above 0, or "none" to remove that limit."""
    if text.lower() == "none":
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number (or none to remove the limit)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be above 0 (or none to remove the limit)")
    return value


def _weight(text: str) -> float:
    """argparse type of a weight: a number above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a number above 0")
    return value


def _member(text: str) -> tuple[str, float]:
    """argparse type of ``--member MODEL=WEIGHT``."""
    model, sep, weight = text.rpartition("=")
    if not sep or not model:
        raise argparse.ArgumentTypeError(f"{text!r} is not MODEL=WEIGHT, e.g. llama3:8b=2")
    return model, _weight(weight)


def _quota_entry(args: argparse.Namespace) -> dict:
    """The entry ``quota set`` sends (controller/quotas.py); CtlError (exit 2) when the options do not fit."""
    limits = {f: getattr(args, f) for f in _LIMIT_OPTIONS if getattr(args, f) is not _UNSET}
    if args.group is not None:
        if args.tenant or args.model or limits or args.weight is not None or args.priority:
            raise CtlError("--group takes only --member options", EXIT_USAGE)
        if not args.member:
            raise CtlError("--group needs at least one --member MODEL=WEIGHT", EXIT_USAGE)
        members = dict(args.member)
        if len(members) != len(args.member):
            raise CtlError("--member: a model is listed twice", EXIT_USAGE)
        if args.group in members:
            raise CtlError(f"--member: group {args.group!r} cannot list itself as a model", EXIT_USAGE)
        return {"group": args.group, "members": members}
    if args.member:
        raise CtlError("--member goes with --group", EXIT_USAGE)
    if args.tenant is not None:
        entry = {"tenant": args.tenant, **limits}
        if args.model is not None:
            if not limits:
                raise CtlError("--tenant with --model needs a limit: --tokens-per-minute, --requests-per-minute or "
                               "--max-concurrent", EXIT_USAGE)
            entry["model"] = args.model
        if args.weight is not None:
            entry["weight"] = args.weight
        if args.priority:
            entry["priority"] = args.priority
        if len(entry) == 1:
            raise CtlError("nothing to set: give a limit, --weight or --priority", EXIT_USAGE)
        return entry
    if args.model is not None:
        if args.weight is not None or args.priority:
            raise CtlError("--weight and --priority are a tenant's: add --tenant", EXIT_USAGE)
        if not limits:
            raise CtlError("--model needs a limit: --tokens-per-minute, --requests-per-minute or --max-concurrent",
                           EXIT_USAGE)
        return {"model": args.model, **limits}
    raise CtlError("say what to set: --tenant T [--model M], --model M, or --group G", EXIT_USAGE)


def _quota_set(api: _Api, args: argparse.Namespace) -> None:
    entry = _quota_entry(args)
    body = api.call("POST", "/v1/quotas", json=entry)
    what = ", ".join(f"{k}={'none' if v is None else v}" for k, v in entry.items()
                     if k not in ("tenant", "group", "model") or (k == "model" and "tenant" in entry))
    name = next(f"{k} {entry[k]}" for k in ("group", "tenant", "model") if k in entry)
    _emit(args, body, lambda: (f"quota of {name} set: {what}" if body["changed"] else
                               f"quota of {name} unchanged: {what}") + f" (revision {body['revision']})")


def _quota_list(api: _Api, args: argparse.Namespace) -> None:
    body = api.call("GET", "/v1/quotas")
    _emit(args, body, lambda: quota_tables(body))


def _quota_delete(api: _Api, args: argparse.Namespace) -> None:
    if args.all:
        if args.tenant or args.model or args.group:
            raise CtlError("--all goes alone", EXIT_USAGE)
        params, name = {"all": "true"}, "every quota (balancers use their config's again)"
    elif args.group is not None:
        if args.tenant or args.model:
            raise CtlError("--group goes alone", EXIT_USAGE)
        params, name = {"group": args.group}, f"group {args.group}"
    elif args.tenant is not None:
        params = {"tenant": args.tenant, **({"model": args.model} if args.model is not None else {})}
        name = f"tenant {args.tenant}" + (f"'s limit on {args.model}" if args.model is not None else "")
    elif args.model is not None:
        params, name = {"model": args.model}, f"the limit of model {args.model}"
    else:
        raise CtlError("say what to delete: --tenant T [--model M], --model M, --group G, or --all", EXIT_USAGE)
    body = api.call("DELETE", "/v1/quotas", params=params)
    _emit(args, body, lambda: f"deleted {name} (revision {body['revision']})")


# --- the whole system ---------------------------------------------------------------------------------------------

def _membership(api: _Api, args: argparse.Namespace) -> None:
    m = api.call("GET", "/v1/membership")
    _emit(args, m, lambda: "\n".join([
        f"revision: {m['revision']}", f"regions: {', '.join(m['regions']) or '(none)'}",
        f"\nbalancers:\n{balancer_table(m['balancers'], m.get('assignments'))}",
        f"\nreplicas:\n{replica_table(m['replicas'])}"]))


def _status(api: _Api, args: argparse.Namespace) -> None:
    membership = api.call("GET", "/v1/membership")
    statuses = {b["url"]: balancer_status(b["url"], min(api.timeout_s, 3.0), api.peer_token)
                for b in membership["balancers"]}
    view = system_status(membership, statuses)
    _emit(args, view, lambda: status_tables(view))


# --- parser -------------------------------------------------------------------------------------------------------

def _output_options() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-o", "--output", choices=("table", "json"), default="table",
                        help="print a table or sentence (default), or JSON")
    common.add_argument("--json", dest="output", action="store_const", const="json", help="same as -o json")
    return common


def _wait_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-wait", dest="wait", action="store_false",
                        help="return once the drain has started, without waiting for in-flight requests")
    parser.add_argument("--wait-timeout", metavar="S", type=float, default=600.0,
                        help="seconds to wait for in-flight requests before giving up with exit status 3 "
                             "(default: 600)")


def build_parser() -> argparse.ArgumentParser:
    """The `skylb-ctl` argument parser (each command stores its function in ``args.run``)."""
    parser = SuggestingParser(
        prog="skylb-ctl", description=__doc__.split("\n\n")[0].replace("\n", " "), epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--controller", metavar="URL", default=env(CONTROLLER_URL) or DEFAULT_CONTROLLER,
                        help=f"controller URL (default: $SKYLB_CONTROLLER, else {DEFAULT_CONTROLLER})")
    parser.add_argument("--admin-token-file", metavar="FILE",
                        help="file holding the controller's admin token, sent with every change "
                             "(default: $SKYLB_ADMIN_TOKEN, else the file $SKYLB_ADMIN_TOKEN_FILE)")
    parser.add_argument("--peer-token-file", metavar="FILE",
                        help="file holding the balancers' peer token, sent when asking them for their status "
                             "(status, drains) (default: $SKYLB_PEER_TOKEN)")
    parser.add_argument("--timeout", metavar="S", type=float, default=10.0,
                        help="seconds to wait for each answer of the controller or a balancer (default: 10)")
    common = [_output_options()]
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    replica = sub.add_parser("replica", help="add, remove, drain or list replicas (inference engine endpoints)",
                             description="Add, remove, drain or list replicas (inference engine endpoints).")
    rsub = replica.add_subparsers(dest="action", metavar="ACTION", required=True)

    add = rsub.add_parser("add", parents=common, help="register a replica in a region (created on first use)",
                          description="Register a replica in a region; the region is created on first use.")
    add.add_argument("--region", required=True, help="region name, e.g. us")
    add.add_argument("--url", required=True, help="the engine's base URL, e.g. http://10.0.0.5:8000")
    add.add_argument("--engine", default="vllm", choices=ENGINES, metavar="ENGINE",
                     help=f"one of: {', '.join(ENGINES)}; auto detects it by probing (default: vllm)")
    add.add_argument("--max-concurrency", type=int, metavar="N",
                     help="requests the engine runs at once: Ollama's OLLAMA_NUM_PARALLEL, a generic OpenAI "
                          "server's concurrency limit (default: the adapter's, 1 for ollama, 8 for openai), or "
                          "vLLM's --max-num-seqs, SGLang's --max-running-requests, TGI's --max-batch-size (default: "
                          "learned from the engine's metrics, from a batch of 2 up); balancers send no more at once")
    add.add_argument("--id", help="replica id (default: <region>-<n>, chosen by the controller)")
    add.add_argument("--kv-events", dest="kv_events", metavar="tcp://HOST:PORT",
                     help="the engine's KV-cache event endpoint (vLLM --kv-events-config \"endpoint\", as the "
                          "balancer reaches it): its balancer then routes by the engine's exact cache state")
    add.add_argument("--kv-events-replay", dest="kv_events_replay", metavar="tcp://HOST:PORT",
                     help="the engine's replay socket (vLLM \"replay_endpoint\"), for missed event batches")
    add.add_argument("--kv-block-size", dest="kv_block_size", type=int, metavar="N",
                     help="tokens per KV-cache block, when not the one the engine's events report")
    add.set_defaults(run=_replica_add)

    for name, run, help_, desc in (
            ("remove", _replica_remove, "unregister a replica by id or by URL",
             "Unregister a replica, given its id or its URL. Drain it first to let in-flight requests finish."),
            ("drain", _replica_drain, "stop new requests to a replica; wait until its in-flight ones are done",
             "Stop sending new requests to a replica (every balancer), then wait until the requests in flight on "
             "it are done and say so. The replica stays registered: remove it, or undrain it."),
            ("undrain", _replica_undrain, "let a drained replica take new requests again",
             "Let a drained replica take new requests again.")):
        cmd = rsub.add_parser(name, parents=common, help=help_, description=desc)
        which = cmd.add_mutually_exclusive_group(required=True)
        which.add_argument("id", nargs="?", help="replica id, as shown by `replica list`")
        which.add_argument("--url", help="the replica with this URL instead")
        if name == "drain":
            _wait_options(cmd)
        cmd.set_defaults(run=run)

    lst = rsub.add_parser("list", parents=common, help="list replicas",
                          description="List replicas, sorted by region then id.")
    lst.add_argument("--region", help="only this region's replicas")
    lst.set_defaults(run=_replica_list)

    balancer = sub.add_parser("balancer", help="list, drain or remove balancers (one or more per region)",
                              description="List, drain or remove the balancers that registered with the "
                                          "controller.")
    bsub = balancer.add_subparsers(dest="action", metavar="ACTION", required=True)
    blst = bsub.add_parser("list", parents=common, help="list balancers: heartbeat, health, drain, what each serves",
                           description="List balancers: when each last sent a heartbeat, the controller's health "
                                       "check, drain, and the regions whose replicas it serves (with the epoch).")
    blst.set_defaults(run=_balancer_list)
    bdrain = bsub.add_parser(
        "drain", parents=common, help="stop a region's balancers taking requests; wait until they are empty",
        description="Drain a region's balancers: the region stops being live, so its replicas (and, through DNS, "
                    "its clients) move to the closest live region's balancer; what it still has queued is "
                    "forwarded or finished. Waits until nothing is queued or in flight there.")
    bdrain.add_argument("region", help="the region whose balancers to drain")
    _wait_options(bdrain)
    bdrain.set_defaults(run=_balancer_drain)
    bundrain = bsub.add_parser("undrain", parents=common, help="end a region's drain",
                               description="End a region's drain: once healthy, its balancers take back its "
                                           "replicas and clients.")
    bundrain.add_argument("region", help="the region whose balancers to undrain")
    bundrain.set_defaults(run=_balancer_undrain)
    bremove = bsub.add_parser("remove", parents=common, help="unregister a balancer by URL",
                              description="Unregister a balancer (stop it first: a running balancer registers "
                                          "again at its next heartbeat).")
    bremove.add_argument("url", help="the balancer's URL, as shown by `balancer list`")
    bremove.set_defaults(run=_balancer_remove)

    _quota_parsers(sub, common)

    membership = sub.add_parser("membership", parents=common, help="show the whole membership and its revision",
                                description="Show the whole membership (regions, balancers, replicas, "
                                            "assignments) and its revision.")
    membership.set_defaults(run=_membership)

    status = sub.add_parser("status", parents=common, help="the whole system at a glance, live",
                            description="One view of the system: which balancer serves each region (failover), "
                                        "each balancer (health, drain, reachable, what it serves, available "
                                        "replicas, queue, in flight, forwarded and forwarded per second) and each "
                                        "replica (health, drain, and from its balancer: available or why not, "
                                        "pending, running, in flight). Balancers are asked directly (their "
                                        "operator status endpoint; $SKYLB_PEER_TOKEN is sent when set).")
    status.set_defaults(run=_status)
    return parser


#: The default of a limit option not given (None means "none": remove that limit).
_UNSET = object()


def _quota_parsers(sub: argparse._SubParsersAction, common: list[argparse.ArgumentParser]) -> None:
    """`skylb-ctl quota set | list | delete`."""
    quota = sub.add_parser(
        "quota", help="set, list or delete quotas: tenants, model limits, model groups",
        description="Quotas in the controller: every balancer applies a change within one watch round trip, "
                    "without restart. While the controller holds none, balancers use their config's `quotas`.")
    qsub = quota.add_subparsers(dest="action", metavar="ACTION", required=True)
    qset = qsub.add_parser(
        "set", parents=common, help="set one entry: a tenant (or its limit on a model), a model's limit, a group",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Set one quota entry. Options left out keep their value; a limit given as `none` is removed.\n"
                    "  --tenant T [--model M] LIMITS [--weight W] [--priority P]   tenant T's limit on model M "
                    "(default: on all its models together), its weight and priority class\n"
                    "  --model M LIMITS                                           model M's own limit, whatever "
                    "the tenant\n"
                    "  --group G --member MODEL=WEIGHT ...                        model group G (replaces its "
                    "members)\n"
                    "LIMITS: --tokens-per-minute N, --requests-per-minute N, --max-concurrent N (N > 0, or none).")
    qset.add_argument("--tenant", metavar="T", help="the tenant (the name its API keys map to; `default` for "
                                                    "requests without one)")
    qset.add_argument("--model", metavar="M", help="with --tenant: the model the limit is on (`*`: all models); "
                                                   "alone: the model whose own limit to set")
    qset.add_argument("--group", metavar="G", help="a model group alias, e.g. fast")
    qset.add_argument("--member", metavar="MODEL=WEIGHT", type=_member, action="append", default=[],
                      help="with --group: a model serving it and its weight (> 0); repeat for each model")
    for option, help_ in (("--tokens-per-minute", "prompt plus max_tokens admitted per minute"),
                          ("--requests-per-minute", "requests admitted per minute"),
                          ("--max-concurrent", "requests in flight at once")):
        qset.add_argument(option, metavar="N", type=_positive_or_none, default=_UNSET,
                          help=f"{help_} (N > 0; none removes this limit)")
    qset.add_argument("--weight", type=_weight, metavar="W",
                      help="with --tenant: its share of the queue when tenants compete (> 0, default 1)")
    qset.add_argument("--priority", choices=PRIORITIES,
                      help="with --tenant: the class of its requests without an X-Priority header (default normal)")
    qset.set_defaults(run=_quota_set)
    qlist = qsub.add_parser("list", parents=common, help="list every quota (tenants, models, groups)",
                            description="List the controller's quotas: tenants with their weight, class and "
                                        "limits; models' limits; model groups. `(none)` when the controller holds "
                                        "none (balancers use their config's).")
    qlist.set_defaults(run=_quota_list)
    qdel = qsub.add_parser("delete", parents=common, help="delete one entry (or --all)",
                           description="Delete one quota entry: a tenant (with --model, only its limit on that "
                                       "model), a model's limit, or a group. --all clears every quota: balancers "
                                       "go back to their config's.")
    qdel.add_argument("--tenant", metavar="T", help="the tenant to delete (all its limits, weight and class)")
    qdel.add_argument("--model", metavar="M", help="with --tenant: only its limit on M; alone: model M's limit")
    qdel.add_argument("--group", metavar="G", help="the model group to delete")
    qdel.add_argument("--all", action="store_true", help="delete every quota")
    qdel.set_defaults(run=_quota_delete)


def _fail(message: str, status: int) -> int:
    print(f"skylb-ctl: error: {message}", file=sys.stderr)
    return status


def main(argv: list[str] | None = None) -> int:
    """Entry point of `skylb-ctl`; returns the exit status (see the module docstring)."""
    args = build_parser().parse_args(argv)
    if args.timeout <= 0:
        return _fail("--timeout must be > 0", EXIT_USAGE)
    if getattr(args, "wait_timeout", 1.0) <= 0:
        return _fail("--wait-timeout must be > 0", EXIT_USAGE)
    try:
        token = env(ADMIN_TOKEN_ENV)
        token_file = args.admin_token_file or (None if token else env(ADMIN_TOKEN_FILE_ENV))
        if token_file:
            try:
                token = read_token_file(token_file)
            except ValueError as exc:
                raise CtlError(f"--admin-token-file: {exc}", EXIT_USAGE) from None
        peer_token = None
        if args.peer_token_file:
            try:
                peer_token = read_token_file(args.peer_token_file)
            except ValueError as exc:
                raise CtlError(f"--peer-token-file: {exc}", EXIT_USAGE) from None
        args.run(_Api(args.controller, args.timeout, token, peer_token), args)
    except CtlError as exc:
        return _fail(str(exc), exc.status)
    except BrokenPipeError:  # `skylb-ctl replica list | head`: the reader left; not an error worth a traceback
        sys.stderr.close()
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
