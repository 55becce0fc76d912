"""Secrets shared by the controller, the balancers and skylb-ctl: their environment variables, reading a token file,
comparing a presented secret with the configured ones, and throttling the client addresses that guess them
(``GuessThrottle``).

Kept free of heavy imports (no aiohttp, no pydantic) so `skylb-ctl` starts fast.
"""

from __future__ import annotations

import hmac
import ipaddress
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

__all__ = ["ADMIN_TOKEN_ENV", "ADMIN_TOKEN_FILE_ENV", "PEER_TOKEN_ENV", "PLACEHOLDER_PREFIX", "MIN_TOKEN_CHARS",
           "MIN_TOKEN_DISTINCT", "check_token",
           "read_token_file", "secret_matches", "from_this_machine", "GuessThrottle", "GUESS_FREE_FAILURES",
           "GUESS_LOCK_BASE_S", "GUESS_LOCK_MAX_S", "GUESS_FORGET_S", "GUESS_MAX_ADDRESSES"]

#: The controller's admin token (every change of membership; skylb-ctl sends it).
ADMIN_TOKEN_ENV = "SKYLB_ADMIN_TOKEN"
#: A file holding the admin token (a systemd credential, a mounted Kubernetes Secret).
ADMIN_TOKEN_FILE_ENV = "SKYLB_ADMIN_TOKEN_FILE"
#: The balancers' shared secret (peer endpoints, forwarded requests, heartbeats to the controller).
PEER_TOKEN_ENV = "SKYLB_PEER_TOKEN"
#: How the example token files in deploy/ begin: a token that still does is a secret everybody knows.
PLACEHOLDER_PREFIX = "replace-with-"


#: The least a peer or admin token must have: this many characters ...
MIN_TOKEN_CHARS = 32
#: ... this many of them different (a run of one letter, or a word padded with one, is no secret) ...
MIN_TOKEN_DISTINCT = 10
#: ... and only printable ASCII without spaces, what a header, a cookie and an env file carry unchanged.
#: `secrets.token_urlsafe(32)` (43 characters) and `openssl rand -hex 32` (64) pass.
GENERATE_HINT = "python -c 'import secrets; print(secrets.token_urlsafe(32))' (or openssl rand -hex 32)"


def check_token(name: str, token: str | None, *, strong: bool = True) -> str | None:
    """``token`` unchanged. Raises ValueError naming ``name`` and the rule (never the value) when it is still the
    deployment files' placeholder (a forgotten install step stops the process instead of running with a public
    secret) or, with ``strong`` (peer and admin tokens), when it is weaker than the minimum above (a guessable
    secret opens membership changes and peer endpoints)."""
    if token is None:
        return None
    if token.startswith(PLACEHOLDER_PREFIX):
        raise ValueError(f"{name} is still the example placeholder; generate one with {GENERATE_HINT}")
    if strong and (len(token) < MIN_TOKEN_CHARS or len(set(token)) < MIN_TOKEN_DISTINCT
                   or not all("!" <= c <= "~" for c in token)):
        raise ValueError(
            f"{name} is too weak: it needs at least {MIN_TOKEN_CHARS} characters, at least {MIN_TOKEN_DISTINCT} of "
            f"them different, all printable ASCII without spaces (it has {len(token)} characters, "
            f"{len(set(token))} different); generate one with {GENERATE_HINT}")
    return token


def read_token_file(path: str) -> str:
    """The token in the file at ``path`` (surrounding whitespace stripped). Raises ValueError naming the path (never
    the content) when it cannot be read or is empty."""
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise ValueError(f"cannot read the token file {path}: {exc.strerror}") from None
    if not token:
        raise ValueError(f"the token file {path} is empty")
    return token


def secret_matches(given: str | None, *secrets: str | None) -> bool:
    """True when ``given`` equals one of the configured ``secrets`` (None ones are skipped); constant-time per
    comparison, and every secret is compared so the time does not say which one matched.

    ``given`` may be any text a client sent: a header value with invalid UTF-8 arrives as lone surrogates (aiohttp
    and ``os.environ`` decode with ``surrogateescape``), compared as the bytes they stand for; text that encodes to no
    bytes at all matches nothing. Never raises."""
    given_bytes = _raw_bytes(given) if given else None
    if not given_bytes:
        return False
    found = False
    for secret in secrets:
        secret_bytes = _raw_bytes(secret) if secret else None
        if secret_bytes:
            found |= hmac.compare_digest(secret_bytes, given_bytes)
    return found


def _raw_bytes(text: str) -> bytes | None:
    """``text`` as the bytes it was decoded from (UTF-8 with ``surrogateescape``), or None when no bytes make it
    (a lone surrogate outside the escape range)."""
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return None


def from_this_machine(remote: str | None) -> bool:
    """True when a request's peer address (aiohttp's ``request.remote``) is a loopback address (127.0.0.0/8, ::1)
    or a Unix socket (None, ""): what an endpoint whose secret is not configured still answers, as Redis's protected
    mode does, so a deployment that forgot its tokens is not open to the network."""
    if not remote:
        return True
    try:
        return ipaddress.ip_address(remote.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


#: Wrong credentials in a row from one address that are free; the next locks it out (OWASP's authentication cheat
#: sheet: lock out after a few failures, with a growing delay).
GUESS_FREE_FAILURES = 5
#: The first lockout, s; each further wrong credential doubles it, up to GUESS_LOCK_MAX_S (reached at the 16th).
GUESS_LOCK_BASE_S = 1.0
GUESS_LOCK_MAX_S = 900.0
#: An address with no wrong credential for this long starts again from zero failures, s.
GUESS_FORGET_S = 3600.0
#: Addresses tracked at most (the one with the oldest failure is forgotten first), so guesses from many addresses
#: cannot grow memory without bound.
GUESS_MAX_ADDRESSES = 10_000


class GuessThrottle:
    """Wrong credentials per client address, and how long each address is locked out: one per server (a balancer,
    the controller), counting every credential it checks (the status page's login, the peer and admin tokens, client
    API keys, the metrics token), so a guesser gains nothing by moving between them. A caller asks
    ``locked_for_s`` before comparing a presented secret and answers 429 with Retry-After without comparing while it
    is above 0; it calls ``failed`` after a wrong one.

    ``clock``: seconds, monotonic (time.monotonic by default; a test passes its own).
    """

    def __init__(self, *, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        # address -> (wrong credentials in a row, locked out until, last wrong credential), oldest failure first
        self._failures: OrderedDict[str, tuple[int, float, float]] = OrderedDict()

    def locked_for_s(self, address: str) -> float:
        """Seconds ``address`` is still locked out (0.0: it may try)."""
        entry = self._failures.get(address)
        return max(0.0, entry[1] - self._clock()) if entry else 0.0

    def failed(self, address: str) -> float:
        """Record a wrong credential from ``address``; returns the seconds it is now locked out (0.0 for the first
        GUESS_FREE_FAILURES in a row)."""
        now = self._clock()
        count, _, last = self._failures.pop(address, (0, 0.0, now))
        count = 1 if now - last > GUESS_FORGET_S else count + 1
        lock_s = (min(GUESS_LOCK_BASE_S * 2 ** (count - GUESS_FREE_FAILURES - 1), GUESS_LOCK_MAX_S)
                  if count > GUESS_FREE_FAILURES else 0.0)
        self._failures[address] = (count, now + lock_s, now)
        while len(self._failures) > GUESS_MAX_ADDRESSES:
            self._failures.popitem(last=False)
        return lock_s

    def succeeded(self, address: str) -> None:
        """A right credential from ``address``: its failures are forgotten."""
        self._failures.pop(address, None)
