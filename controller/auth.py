"""Who may change membership: the controller's credentials and the aiohttp middleware that checks them.

- Reads (``GET``, ``HEAD``: membership, replicas, balancers, assignments, /healthz) stay open: balancers long-poll
  membership, monitoring and `skylb-ctl status` read it, and it holds no secret (URLs and health only).
- Every change (``POST``, ``DELETE``: replicas, drains, balancer removal) needs the admin token as
  ``Authorization: Bearer <token>``; `skylb-ctl` sends it from ``$SKYLB_ADMIN_TOKEN`` or ``--admin-token-file``.
- A balancer's registration and heartbeat (``POST /v1/balancers``) needs the balancers' peer token as
  ``X-SkyLB-Token`` (what every balancer already holds, so no second secret to deploy to them), or the admin token.
  Taking over a region whose balancer is live at another URL needs the admin token and ``"replace": true``
  (server.py ``register_balancer``).

A credential that is not configured narrows its check to this machine (protected mode, as Redis's: changes, or
registrations, are accepted from loopback addresses only) and the controller logs a warning at start; every
deployment file and `skylb local` configure both. Refusals are 401 ``authentication_error`` in the
controller's error shape. Secrets are compared in constant time and never logged.

Guessing is throttled per client address with the status page's login (one skylb.tokens.GuessThrottle per
controller, ``THROTTLE``): a wrong admin token (``Authorization: Bearer``) or peer token (``X-SkyLB-Token``) on a
change counts as a failure; past GUESS_FREE_FAILURES in a row the address is locked out for a growing time, and a
change presenting either from it gets 429 with Retry-After without being compared; a right one compared outside a
lockout starts the count again. A missing credential is not counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import structlog
from aiohttp import web

from skylb.tokens import (ADMIN_TOKEN_ENV, ADMIN_TOKEN_FILE_ENV, PEER_TOKEN_ENV, GuessThrottle, check_token,
                          from_this_machine, read_token_file, secret_matches)
from skylb.environment import env
from skylb.status_page import OPEN_PATHS as PAGE_PATHS

__all__ = ["ControllerCredentials", "CREDENTIALS", "THROTTLE", "resolve_credentials", "is_admin", "auth_middleware"]

log = structlog.get_logger("skylb.controller")

_READS = frozenset({"GET", "HEAD", "OPTIONS"})


@dataclass
class ControllerCredentials:
    """The controller's secrets; None: that check is off. ``replace_with`` puts new ones in force in place (a
    reload, controller/reload.py): every request reads them from the application, so the next one sees them."""

    admin_token: str | None = None
    peer_token: str | None = None

    def replace_with(self, other: "ControllerCredentials") -> None:
        """Take ``other``'s secrets."""
        self.admin_token, self.peer_token = other.admin_token, other.peer_token

    def __repr__(self) -> str:  # never print a secret by accident
        return (f"ControllerCredentials(admin_token={'set' if self.admin_token else None}, "
                f"peer_token={'set' if self.peer_token else None})")


CREDENTIALS = web.AppKey("credentials", ControllerCredentials)
#: The controller's wrong credentials per client address (the middleware's and the status page's login).
THROTTLE = web.AppKey("guess_throttle", GuessThrottle)


def resolve_credentials(admin_token: str | None, admin_token_file: str | None,
                        peer_token: str | None) -> ControllerCredentials:
    """The credentials from the config's values, overridden by the environment: ``$SKYLB_ADMIN_TOKEN``, then the
    file ``$SKYLB_ADMIN_TOKEN_FILE`` or ``admin_token_file``; ``$SKYLB_PEER_TOKEN``. Raises ValueError (an unreadable
    token file, a token still the deployment files' placeholder)."""
    admin = env(ADMIN_TOKEN_ENV)
    if admin is None and (path := env(ADMIN_TOKEN_FILE_ENV) or admin_token_file):
        admin = read_token_file(path)
    return ControllerCredentials(
        admin_token=check_token("the admin token", admin or admin_token or None),
        peer_token=check_token("the peer token", env(PEER_TOKEN_ENV) or peer_token or None))


def _bearer(request: web.Request) -> str | None:
    scheme, _, value = request.headers.get("Authorization", "").partition(" ")
    return value.strip() if scheme.lower() == "bearer" else None


def is_admin(request: web.Request) -> bool:
    """True when ``request`` carries the admin token, or no admin token is configured and it comes from this machine
    (protected mode)."""
    creds = request.app[CREDENTIALS]
    if creds.admin_token is None:
        return from_this_machine(request.remote)
    return secret_matches(_bearer(request), creds.admin_token)


def _refuse(message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "authentication_error", "code": 401}},
                              status=401, headers={"WWW-Authenticate": 'Bearer realm="skylb-controller"'})


def _locked_out(locked_s: float) -> web.Response:
    wait_s = max(1, math.ceil(locked_s))
    return web.json_response({"error": {"message": f"too many wrong credentials from this address: try again in "
                                        f"{wait_s} s", "type": "rate_limit_exceeded", "code": 429}},
                             status=429, headers={"Retry-After": str(wait_s)})


def _guess_refusal(request: web.Request, creds: ControllerCredentials) -> web.Response | None:
    """429 when ``request`` presents a credential the controller compares (the admin token as Bearer, the peer
    token as X-SkyLB-Token) from an address locked out; else count a presented credential that matches none (the
    429 when that locks the address out) and return None, so the checks below answer as they would; a right one
    starts the address's count again."""
    bearer, token = _bearer(request), request.headers.get("X-SkyLB-Token")
    presented = ((bearer is not None and creds.admin_token is not None)
                 or (token is not None and creds.peer_token is not None))
    if not presented:
        return None
    throttle, address = request.app[THROTTLE], request.remote or ""
    if locked_s := throttle.locked_for_s(address):
        return _locked_out(locked_s)
    if secret_matches(bearer, creds.admin_token) or secret_matches(token, creds.peer_token):
        throttle.succeeded(address)
        return None
    if locked_s := throttle.failed(address):
        log.warning("client_locked_out", locked_s=locked_s, peer=request.remote)
        return _locked_out(locked_s)
    return None


@web.middleware
async def auth_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Refuse a change without its credential (this module's docstring); reads pass."""
    if request.method in _READS or request.path in PAGE_PATHS:  # the status page's login checks the token itself
        return await handler(request)
    creds = request.app[CREDENTIALS]
    if (refusal := _guess_refusal(request, creds)) is not None:
        return refusal
    if request.method == "POST" and request.path == "/v1/balancers":
        peer_ok = (from_this_machine(request.remote) if creds.peer_token is None
                   else secret_matches(request.headers.get("X-SkyLB-Token"), creds.peer_token))
        if peer_ok or secret_matches(_bearer(request), creds.admin_token):
            return await handler(request)
        if creds.peer_token is None:
            return _refuse("no peer token is configured, so balancers may register from this machine only; set "
                           f"controller.peer_token (or ${PEER_TOKEN_ENV}) as on the balancers")
        return _refuse("balancer registration needs the peer token (X-SkyLB-Token) or the admin token")
    if not is_admin(request):
        if creds.admin_token is None:
            return _refuse("no admin token is configured, so changes are accepted from this machine only; set "
                           f"controller.admin_token (or ${ADMIN_TOKEN_ENV}) to manage it from elsewhere")
        return _refuse("this change needs the admin token: Authorization: Bearer <token> "
                       f"(skylb-ctl reads ${ADMIN_TOKEN_ENV} or --admin-token-file)")
    return await handler(request)
