"""Who may call what on a balancer: one aiohttp middleware in front of every route.

- ``GET /healthz``, ``GET /readyz``, ``GET /health`` (the engines' health check) and ``GET``/``HEAD /`` (Ollama's
  "is it running"): open, for load balancers, Kubernetes probes and the controller's health check. To a browser ``/`` is
  the status page, which guards itself (skylb/status_page: the login form, its stylesheet and script are open; the
  page needs the session cookie or protected mode).
- The peer endpoint ``GET /skylb/v1/status`` (msgpack and ``?format=json``): the peer token (``X-SkyLB-Token``), or
  the status page's session cookie (made with the peer token).
- ``GET /metrics``: the metrics token or the peer token, as ``Authorization: Bearer <token>`` (what Prometheus's
  ``authorization`` setting sends); the peer token also as ``X-SkyLB-Token``.
- The client APIs (``/v1/*``, ``/api/*``, the admission API ``/skylb/v1/schedule``, ``heartbeat``, ``complete``,
  ``advice``): a client API key, ``Authorization: Bearer <key>``, when keys are
  configured; 401 in the API's shape otherwise. A request carrying the peer token is a peer's (a forwarded request,
  ``/api/show`` asked of a peer) and needs no client key: the forwarding balancer checked it.
- A request marked forwarded (``X-SkyLB-Forwarded-From``) without the peer token is refused (403): a client cannot
  skip the one-hop rule or the quota gate, or claim queue time (``X-SkyLB-Queue-Ms``) it did not spend elsewhere.
  Without a peer token it is always refused, from this machine too: a balancer with peers needs a token (process.py
  refuses to start without one), so no peer can send it, and a local reverse proxy passes its clients' headers on.

Guessing is throttled per client address with the status page's login (one skylb.tokens.GuessThrottle per balancer):
a wrong peer token (``X-SkyLB-Token``), a wrong client key or metrics token (``Authorization: Bearer``) counts as a
failure, as a wrong login does; past GUESS_FREE_FAILURES in a row the address is locked out for a growing time, and a
request presenting one of these credentials from it gets 429 with Retry-After in the API's shape, without its
credential being compared (right or wrong: a guesser learns nothing while locked out); a right one compared outside
a lockout starts the address's count again, as a right login does. A missing credential is no guess and is not
counted; requests that present none (an open client API, the health checks) are never refused for a lockout. Behind
a reverse proxy or a NAT every client shares one address: a client retrying a wrong key in a loop locks them all out
(for at most GUESS_LOCK_MAX_S, 15 min), and their right keys reset its count between lockouts.

Without a peer token, peer endpoints and /metrics (without a metrics token) answer this machine only (protected
mode, as Redis's: loopback addresses), so a single region that forgot its token is not open to the network; without
keys the client APIs are open (a load balancer's usual default). The credentials may be replaced while
serving (``auth_middleware`` takes a function returning the current ones; a reload, skylb/balancer/reload.py).
process.py logs a warning at start for each check that is narrowed or off. Secrets are compared
in constant time and never logged. Secure by default. Source: OpenAI's and Ollama's error
shapes (api.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from aiohttp import web

from skylb import environment, status_page
from skylb.balancer.api import error_response, openai_error
from skylb.balancer.protocol import FORWARDED_FROM, STATUS_PATH, TOKEN_HEADER
from skylb.core.request import DEFAULT_TENANT
from skylb.tokens import GuessThrottle, from_this_machine, secret_matches

__all__ = ["Credentials", "API_KEYS_ENV", "API_KEYS_FILE_ENV", "METRICS_TOKEN_ENV", "load_api_keys",
           "load_tenants", "auth_middleware", "tenant_of", "TENANT"]

#: Request key: the tenant of a client request (set by the middleware; ``tenant_of`` reads it).
TENANT = web.RequestKey("skylb_tenant", str) if hasattr(web, "RequestKey") else "skylb_tenant"

#: Client API keys, comma-separated (added to ``balancer.api_keys`` and the keys file).
API_KEYS_ENV = environment.API_KEYS.name
#: A file of client API keys, one per line (``#`` starts a comment); overrides ``balancer.api_keys_file``.
API_KEYS_FILE_ENV = environment.API_KEYS_FILE.name
#: The metrics token (overrides ``balancer.metrics_token``).
METRICS_TOKEN_ENV = environment.METRICS_TOKEN.name

log = structlog.get_logger("skylb.balancer")

_OPEN_PATHS = frozenset({"/health", "/healthz", "/readyz", "/"}) | status_page.OPEN_PATHS
_API_PREFIXES = ("/v1/", "/api/")
#: The admission API (skylb/balancer/lease_api.py): client endpoints too; /skylb/v1/status stays peer-only.
_CLIENT_PATHS = frozenset({"/skylb/v1/schedule", "/skylb/v1/heartbeat", "/skylb/v1/complete", "/skylb/v1/advice"})


@dataclass(frozen=True)
class Credentials:
    """The secrets one balancer checks.

    Attributes:
        api_keys: accepted client keys (empty: the client APIs are open). peer_token: the secret shared by the
        balancers (None: peer endpoints open). metrics_token: accepted on /metrics besides the peer token.
    """

    api_keys: frozenset[str] = frozenset()
    peer_token: str | None = None
    metrics_token: str | None = None
    #: {client API key: tenant name} for the keys that belong to a tenant.
    tenants: dict[str, str] = field(default_factory=dict)

    def __repr__(self) -> str:  # never print a secret by accident (a log line, a traceback)
        return (f"Credentials(api_keys={len(self.api_keys)} keys, peer_token={'set' if self.peer_token else None}, "
                f"metrics_token={'set' if self.metrics_token else None})")


def load_api_keys(keys: list[str], keys_file: str | None) -> frozenset[str]:
    """Client API keys from the config list, the keys file (``$SKYLB_API_KEYS_FILE`` over ``keys_file``: one key a
    line, blank lines and ``#`` comments skipped) and ``$SKYLB_API_KEYS`` (comma-separated).

    Raises ValueError when the file cannot be read (its path in the message, never its content).
    """
    found = [k.strip() for k in keys]
    found += [fields[0] for fields in _keys_file_lines(keys_file)]
    found += (k.strip() for k in (environment.env(environment.API_KEYS) or "").split(","))
    return frozenset(k for k in found if k)


def load_tenants(tenants: dict[str, list[str]], keys_file: str | None) -> dict[str, str]:
    """{client API key: tenant} from ``balancer.tenants`` ({tenant: [keys]}) and the keys file's two-field lines
    (``<key> <tenant>``; ``$SKYLB_API_KEYS_FILE`` over ``keys_file``). Every key returned is also a client key
    (``load_api_keys`` reads the same file; pass ``tenants``' keys to it too).

    Raises ValueError when the file cannot be read, or when one key is given to two tenants."""
    out: dict[str, str] = {}

    def add(key: str, tenant: str) -> None:
        if out.setdefault(key, tenant) != tenant:
            raise ValueError(f"one client API key is given to two tenants: {out[key]!r} and {tenant!r}")
    for tenant, keys in tenants.items():
        for key in keys:
            add(key.strip(), tenant)
    for fields in _keys_file_lines(keys_file):
        if len(fields) >= 2:
            add(fields[0], fields[1])
    return out


def _keys_file_lines(keys_file: str | None) -> list[list[str]]:
    """The keys file's non-empty lines as fields (``<key>`` or ``<key> <tenant>``; ``#`` starts a comment),
    ``$SKYLB_API_KEYS_FILE`` over ``keys_file``; [] without a file. Raises ValueError when it cannot be read (its
    path in the message, never its content)."""
    path = environment.env(environment.API_KEYS_FILE) or keys_file
    if not path:
        return []
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"cannot read the API keys file {path}: {exc.strerror}") from None
    return [fields for line in text.splitlines() if (fields := line.split("#", 1)[0].split())]


def tenant_of(request: web.Request) -> str:
    """The tenant of a client request: the one its API key belongs to, else ``default``."""
    return request.get(TENANT, DEFAULT_TENANT)


def _bearer(request: web.Request) -> str | None:
    scheme, _, value = request.headers.get("Authorization", "").partition(" ")
    return value.strip() if scheme.lower() == "bearer" else None


def _peer_refusal(creds: Credentials, what: str) -> str:
    if creds.peer_token:
        return f"{what} needs the peer token: missing or wrong {TOKEN_HEADER}"
    if what == "a forwarded request":
        return ("a forwarded request needs the peer token, and none is configured here (set balancer.peer_token or "
                "$SKYLB_PEER_TOKEN on every balancer)")
    return (f"{what} is answered on this machine only: no peer token is configured (set balancer.peer_token or "
            "$SKYLB_PEER_TOKEN on every balancer)")


def _tenant_of_key(creds: Credentials, key: str | None) -> str | None:
    """The tenant of an accepted ``key`` (compared in constant time, as keys are), or None."""
    found = None
    for candidate, tenant in creds.tenants.items():
        if secret_matches(key, candidate):
            found = tenant
    return found


def _locked_out(api: str, locked_s: float) -> web.Response:
    """429 in the API's shape with Retry-After: the whole seconds ``locked_s`` this address is still locked out."""
    wait_s = max(1, math.ceil(locked_s))
    response = error_response(api, 429, f"too many wrong credentials from this address: try again in {wait_s} s",
                               type_="rate_limit_exceeded")
    response.headers["Retry-After"] = str(wait_s)
    return response


def _wrong(throttle: GuessThrottle, request: web.Request, api: str, credential: str) -> web.Response | None:
    """Count a wrong ``credential`` from ``request``'s address; the 429 when that locked it out, else None."""
    locked_s = throttle.failed(request.remote or "")
    if not locked_s:
        return None
    log.warning("client_locked_out", credential=credential, locked_s=locked_s, peer=request.remote)
    return _locked_out(api, locked_s)


def auth_middleware(creds: Credentials | Callable[[], Credentials], *, throttle: GuessThrottle | None = None):
    """The middleware enforcing the rules in this module's docstring with ``creds``: the Credentials, or a function
    returning those in force at each request (so a reload replaces them without a restart). ``throttle``: the
    balancer's wrong credentials per address, shared with its status page's login (default: one of its own)."""
    current = creds if callable(creds) else (lambda: creds)
    guesses = throttle or GuessThrottle()

    @web.middleware
    async def check_credentials(request: web.Request, handler):
        creds = current()
        path = request.path
        if path in _OPEN_PATHS:
            return await handler(request)
        api = "ollama" if path.startswith("/api/") else "openai"
        token = request.headers.get(TOKEN_HEADER)
        if token is not None and creds.peer_token:  # a peer token to compare: a guess, unless it is right
            if locked_s := guesses.locked_for_s(request.remote or ""):
                return _locked_out(api, locked_s)
            if secret_matches(token, creds.peer_token):
                guesses.succeeded(request.remote or "")
                return await handler(request)  # a peer: trusted on every route
            if locked := _wrong(guesses, request, api, "peer token"):
                return locked
        # Only the status and /metrics ask where the caller is (parsing the address is most of this check's time
        # on a client's request).
        local = from_this_machine(request.remote) if path in (STATUS_PATH, "/metrics") else None
        if path == STATUS_PATH:
            if status_page.session_ok(request, creds.peer_token, status_page.PEER_SESSION):
                return await handler(request)  # the status page of an operator logged in with the peer token
            if creds.peer_token or not local:
                return openai_error(403, _peer_refusal(creds, "the peer status"), type_="permission_error")
        elif path == "/metrics":
            if creds.peer_token or creds.metrics_token:
                bearer = _bearer(request)
                if bearer is not None and (locked_s := guesses.locked_for_s(request.remote or "")):
                    return _locked_out(api, locked_s)
                if not secret_matches(bearer, creds.metrics_token, creds.peer_token):
                    if bearer is not None and (locked := _wrong(guesses, request, api, "metrics token")):
                        return locked
                    return openai_error(403, "missing or wrong metrics token", type_="permission_error")
                guesses.succeeded(request.remote or "")
            elif not local:
                return openai_error(403, _peer_refusal(creds, "/metrics"), type_="permission_error")
        elif FORWARDED_FROM in request.headers:
            return error_response(api, 403, _peer_refusal(creds, "a forwarded request"), type_="permission_error")
        elif creds.api_keys and (path.startswith(_API_PREFIXES) or path in _CLIENT_PATHS):
            key = _bearer(request)
            if key is not None and (locked_s := guesses.locked_for_s(request.remote or "")):
                return _locked_out(api, locked_s)
            if not secret_matches(key, *creds.api_keys):
                if key is not None and (locked := _wrong(guesses, request, api, "client API key")):
                    return locked
                message = "missing API key: send Authorization: Bearer <key>" if key is None else "invalid API key"
                if api == "ollama":
                    return error_response(api, 401, message)
                return web.json_response({"error": {"message": message, "type": "authentication_error",
                                                    "param": None, "code": "invalid_api_key"}}, status=401,
                                         headers={"WWW-Authenticate": 'Bearer realm="skylb"'})
            guesses.succeeded(request.remote or "")
            tenant = _tenant_of_key(creds, key)
            if tenant is not None:
                request[TENANT] = tenant
        return await handler(request)

    return check_credentials
