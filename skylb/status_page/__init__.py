"""The status page: one HTML page with its stylesheet and script (package data, no build step), the login form and
the session cookie that guard it.

The controller serves it at ``/`` for the whole system and a balancer for its own region (to a browser: a request
that accepts ``text/html``; Ollama's clients still get "Ollama is running"). The script polls
``/skylb/v1/status?format=json`` every two seconds and draws what it answers, with the membership revision and the
time of that snapshot.

Who may see it, as the other operator endpoints (never a token in a URL):

- No credential configured (the controller's admin token, a balancer's peer token): this machine only (protected
  mode, as Redis's): a loopback client gets the page, others a 403 page saying what to configure.
- Configured: a browser logs in with a form that POSTs the token (``/skylb/login``); the answer sets a session
  cookie (``HttpOnly``, ``SameSite=Strict``, ``Secure`` over HTTPS) holding an expiry and an HMAC-SHA256 of it keyed
  by the token (RFC 2104), so no session is stored, several controllers sharing the token accept each other's
  sessions, and changing the token ends every session. A reverse proxy that authenticates operators its own way
  may instead send ``Authorization: Bearer <token>`` upstream.

Guesses are throttled per client address (skylb.tokens.GuessThrottle, shared with the server's other credential
checks): GUESS_FREE_FAILURES wrong tokens in a row are free; the next locks the address out for a second, each
further one twice as long as the last (at most GUESS_LOCK_MAX_S); a login while locked out gets 429 with Retry-After
and is not checked, nor is a proxy's ``Authorization: Bearer`` (the page answers as to no credential). Behind a
reverse proxy every client shares the proxy's address, so one guesser locks the proxy's operators out for as long.

Source: the cookie attributes from RFC 6265 §4.1.2 and the SameSite draft (draft-ietf-httpbis-rfc6265bis §4.1.2.7).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import html
import math
import time
from dataclasses import dataclass, field
from importlib import resources

from aiohttp import web

from skylb.tokens import GuessThrottle, from_this_machine, secret_matches

__all__ = ["PageAccess", "ACCESS", "ADMIN_SESSION",
           "PEER_SESSION", "SESSION_TTL_S", "LOGIN_PATH", "LOGOUT_PATH", "STATIC_PREFIX", "FAVICON_PATH", "OPEN_PATHS",
           "session_value", "session_ok", "wants_html", "handle_page", "ROUTES"]

#: The session cookies' names: the controller's (admin token) and the balancers' (peer token), apart so that a
#: controller and a balancer on one host (ports do not separate cookies, RFC 6265 §8.5) keep their sessions.
ADMIN_SESSION = "skylb_admin_session"
PEER_SESSION = "skylb_peer_session"
#: How long a login lasts (s).
SESSION_TTL_S = 12 * 3600
LOGIN_PATH = "/skylb/login"
LOGOUT_PATH = "/skylb/logout"
STATIC_PREFIX = "/skylb/static"
#: What a browser asks of every site: answered 204 (no icon, and no 404 in the request log).
FAVICON_PATH = "/favicon.ico"
#: Paths that need no credential: the login form's target, the logout, the stylesheet, the script, the favicon.
OPEN_PATHS = frozenset({LOGIN_PATH, LOGOUT_PATH, f"{STATIC_PREFIX}/page.css", f"{STATIC_PREFIX}/page.js",
                        FAVICON_PATH})
#: The header's logout form, shown only to a browser that logged in (a session cookie).
_LOGOUT_FORM = f'<form method="post" action="{LOGOUT_PATH}"><button type="submit">Log out</button></form>'

_STATIC = resources.files(__package__) / "static"
_TYPES = {"page.css": "text/css", "page.js": "text/javascript"}
#: The page loads only its own stylesheet and script and calls only its own origin; nobody may frame it.
_HEADERS = {"Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'; form-action 'self'",
            "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer", "Cache-Control": "no-store"}


@dataclass(frozen=True)
class PageAccess:
    """The credential guarding the page on one server.

    Attributes:
        token: the secret a login must present (the controller's admin token, a balancer's peer token); None: none
            is configured, so the page answers this machine only.
        credential: its name for people ("the admin token"), shown on the login form and the 403 page.
        scope: what the page shows ("controller" or "region us"), shown in its title.
        cookie: the session cookie's name (ADMIN_SESSION or PEER_SESSION).
        throttle: the wrong credentials per client address (skylb.tokens.GuessThrottle), the server's one throttle
            when it passes its own (its other credential checks count on it too).
    """

    token: str | None
    credential: str
    scope: str
    cookie: str = ADMIN_SESSION
    throttle: GuessThrottle = field(default_factory=GuessThrottle, compare=False)

    def __repr__(self) -> str:  # never print a secret by accident
        return f"PageAccess(token={'set' if self.token else None}, credential={self.credential!r})"

    def allowed(self, request: web.Request) -> bool:
        """True when ``request`` may read the page's data: a valid session cookie, the token as ``Authorization:
        Bearer`` (a reverse proxy), or, with no token configured, a loopback client. A Bearer token is a guess as a
        login is: counted on ``throttle`` when wrong, and not compared (False) while its address is locked out."""
        if self.token is None:
            return from_this_machine(request.remote)
        if session_ok(request, self.token, self.cookie):
            return True
        scheme, _, value = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        address = request.remote or ""
        if self.throttle.locked_for_s(address):
            return False
        if secret_matches(value.strip(), self.token):
            self.throttle.succeeded(address)
            return True
        self.throttle.failed(address)
        return False


ACCESS = web.AppKey("status_page_access", PageAccess)


def _mac(token: str, cookie: str, expiry: int) -> str:
    message = f"skylb status page {cookie} {expiry}".encode()
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


def session_value(token: str, cookie: str, now: float) -> str:
    """The value of session cookie ``cookie`` for ``token``, valid SESSION_TTL_S seconds from ``now`` (unix s):
    ``"<expiry>.<hex HMAC-SHA256>"``."""
    expiry = int(now) + SESSION_TTL_S
    return f"{expiry}.{_mac(token, cookie, expiry)}"


def session_ok(request: web.Request, token: str | None, cookie: str, now: float | None = None) -> bool:
    """True when ``request`` carries an unexpired session cookie ``cookie`` made with ``token`` (False when
    ``token`` is None: without a token there are no sessions). A cookie of any other shape (an expiry that is not
    ASCII digits: ``str.isdigit`` also accepts '١' and '²'; a MAC that is not ASCII) is no session; never raises."""
    expiry, _, mac = request.cookies.get(cookie, "").partition(".")
    if token is None or not (expiry.isascii() and expiry.isdigit()) or len(expiry) > 12 or not mac.isascii():
        return False
    if int(expiry) < (time.time() if now is None else now):
        return False
    return hmac.compare_digest(mac.encode(), _mac(token, cookie, int(expiry)).encode())


def wants_html(request: web.Request) -> bool:
    """True when the client asks for HTML (a browser's ``Accept``), so ``/`` is the page rather than an API's
    answer."""
    return "text/html" in request.headers.get("Accept", "")


@functools.cache  # package data: read once
def _asset(name: str) -> str:
    return (_STATIC / name).read_text(encoding="utf-8")


def _html(name: str, status: int, access: PageAccess, message: str = "", logout: bool = False) -> web.Response:
    body = (_asset(name).replace("{scope}", html.escape(access.scope))
            .replace("{credential}", html.escape(access.credential)).replace("{message}", html.escape(message))
            .replace("{logout}", _LOGOUT_FORM if logout else ""))
    return web.Response(text=body, status=status, content_type="text/html", headers=_HEADERS)


async def handle_page(request: web.Request) -> web.Response:
    """``GET /``: the page when the client is allowed (``PageAccess.allowed``), else the login form (401), or a
    403 page when no credential is configured and the client is not on this machine."""
    access = request.app[ACCESS]
    if access.allowed(request):  # Log out only for a session: protected mode and a proxy's Bearer have none
        return _html("index.html", 200, access, logout=session_ok(request, access.token, access.cookie))
    if access.token is None:
        return _html("closed.html", 403, access)
    return _html("login.html", 401, access)


async def _login(request: web.Request) -> web.Response:
    """``POST /skylb/login`` (form field ``token``): 303 to ``/`` with the session cookie, or the form again (401)
    saying the token was wrong, or (429, with Retry-After) that this address is locked out for guessing."""
    access = request.app[ACCESS]
    if access.token is None:
        raise web.HTTPSeeOther("/")  # nothing to log in to: the page answers this machine only
    address = request.remote or ""
    if locked_s := access.throttle.locked_for_s(address):
        return _locked_out(access, locked_s)
    form = await request.post()
    token = form.get("token")
    if not isinstance(token, str) or not secret_matches(token.strip(), access.token):
        if locked_s := access.throttle.failed(address):
            return _locked_out(access, locked_s)
        return _html("login.html", 401, access, f"That is not {access.credential}.")
    access.throttle.succeeded(address)
    response = web.Response(status=303, headers={"Location": "/", "Cache-Control": "no-store"})
    response.set_cookie(access.cookie, session_value(access.token, access.cookie, time.time()),
                        max_age=SESSION_TTL_S, path="/", httponly=True, samesite="Strict", secure=request.secure)
    return response


def _locked_out(access: PageAccess, locked_s: float) -> web.Response:
    """The login form (429) saying this address must wait ``locked_s`` seconds, with that as Retry-After."""
    wait_s = max(1, math.ceil(locked_s))
    response = _html("login.html", 429, access, f"Too many wrong tokens from this address: try again in {wait_s} s.")
    response.headers["Retry-After"] = str(wait_s)
    return response


async def _logout(request: web.Request) -> web.Response:
    """``POST /skylb/logout``: 303 to ``/`` with the session cookie removed."""
    response = web.Response(status=303, headers={"Location": "/", "Cache-Control": "no-store"})
    response.del_cookie(request.app[ACCESS].cookie, path="/")
    return response


async def _static(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if name not in _TYPES:
        raise web.HTTPNotFound()
    return web.Response(text=_asset(name), content_type=_TYPES[name],
                        headers={"X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"})


async def _favicon(request: web.Request) -> web.Response:
    """``GET /favicon.ico``: 204, no icon."""
    return web.Response(status=204, headers={"Cache-Control": "max-age=86400"})


#: The login, logout, asset and favicon routes (``/`` itself is the server's: the balancer shares it with Ollama's).
ROUTES = [web.post(LOGIN_PATH, _login), web.post(LOGOUT_PATH, _logout),
          web.get(STATIC_PREFIX + "/{name}", _static), web.get(FAVICON_PATH, _favicon)]
