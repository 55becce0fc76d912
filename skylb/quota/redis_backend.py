"""Quota buckets in Redis, shared by every balancer, so a limit is global; with a fallback to this balancer's share
when Redis is unreachable.

Source: the LLM-Load-Balancer README, "Iteration 1" ("state lives in Redis", "all writes use Lua
scripts") and "Iteration 2" (leases). One Lua script per operation, so each is atomic on the server:

* acquire: refill every bucket of the request from the time since its last update (Redis server ``TIME``, so
  balancers' clocks do not matter), check all of them, and charge all or none; the same arithmetic as
  ``LocalLimits`` (skylb/quota/buckets.py: start full, refill ``per_minute / 60`` per second, a charge cut to the
  capacity, the longest refusal decides the wait, a slot refusal outranks a refill).
* release: refill, free the request's slot, refund unused tokens.
* renew: extend the leases of the slots this balancer holds.

Keys, under ``quota.key_prefix``: ``<prefix>b:<bucket key>`` a hash {tokens, requests, ts} (idle for
``BUCKET_TTL_S`` it expires: by then it would have refilled to full, which is what a missing key means), and
``<prefix>s:<bucket key>`` a sorted set of the concurrency slots in use, each scored by its lease's expiry. A slot is
leased for ``quota.slot_lease_s``; this balancer renews the leases of its requests in flight every third of it, and
the acquire script drops expired ones first, so a balancer that dies, or loses Redis, holds slots at most one lease
longer than its requests ran.

Failure mode. When a Redis call fails or takes longer than ``quota.redis_timeout_s``, this balancer falls back at
once to a ``LocalLimits`` holding its share of every limit (``quota.local_share``, else the share the controller
assigned with ``set_share``, else 1 / the number of regions in membership), keeps serving, logs
``quota_redis_unreachable``, sets the metric ``skylb_quota_redis_fallback`` and the status field
``quota.redis_fallback``, and tries Redis again every ``quota.redis_retry_s`` from its upkeep loop, never on a
request's path (then logs ``quota_redis_recovered``).

How much a limit can be exceeded meanwhile. The local buckets start full, and they know nothing of what Redis
counted before the outage. A limit of L tokens (or requests) per minute admits, over any interval of T seconds, at
most L + L * T / 60 through Redis (a full bucket, then its refill). In an interval that overlaps a fallback, the
balancers together add at most their shares' full buckets (the shares sum to 1, so L) plus the same refill; and
when Redis comes back its bucket has refilled during the outage, so the interval after a recovery may add one more
L. Hence: over any interval of T seconds, at most (1 + k) * L + L * T / 60, where k is the number of fallbacks and
recoveries inside it (one extra bucket per switch, in the worst case; with shares that sum to 1). For example a
60 s window containing one fallback admits at most 3 L, against 2 L without an outage. A concurrency cap C can
reach C (slots still held in Redis by requests admitted before the outage) plus sum(max(1, floor(C * share)))
<= C + N - 1 for N balancers while both kinds run; the Redis slots end with their requests or their leases.
A balancer that cannot reach Redis while its peers can enforces its share locally and they enforce the global
limit in Redis: the total is then bounded by L plus that balancer's share, as above.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis
import structlog
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from skylb.quota.buckets import Grant, LocalLimits
from skylb.quota.limits import Limit
from skylb.quota.settings import QuotaSettings

__all__ = ["RedisLimits", "RedisGrant", "BUCKET_TTL_S", "ACQUIRE_LUA", "RELEASE_LUA", "RENEW_LUA"]

#: Idle seconds after which a bucket hash expires: after 60 s without a charge any bucket is full again.
BUCKET_TTL_S = 120

log = structlog.get_logger("skylb.quota")

# Shared by the scripts: the time (ARGV[1], or the server's clock when empty), a bucket's refilled state, and
# numbers written back with 17 significant digits (Lua's tostring keeps 14: levels would drift from LocalLimits').
_PRELUDE = """
local function clock()
  if ARGV[1] ~= '' then return tonumber(ARGV[1]) end
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local function num(x) return string.format('%.17g', x) end
local function load(key, tpm, rpm, now)
  local h = redis.call('HMGET', key, 'tokens', 'requests', 'ts')
  local tok, req, ts = tonumber(h[1]), tonumber(h[2]), tonumber(h[3])
  if ts == nil then tok = tpm or 0; req = rpm or 0; ts = now end
  local dt = math.max(0, now - ts)
  if tpm then tok = math.min(tpm, tok + dt * tpm / 60) end
  if rpm then req = math.min(rpm, req + dt * rpm / 60) end
  return tok, req, math.max(ts, now)
end
local function save(key, tok, req, ts, ttl_ms)
  redis.call('HSET', key, 'tokens', num(tok), 'requests', num(req), 'ts', num(ts))
  redis.call('PEXPIRE', key, ttl_ms)
end
"""

#: KEYS: per bucket, its hash and its slot set. ARGV: now ('' = server TIME), tokens, slot member, lease (s),
#: bucket TTL (ms), then per bucket tokens_per_minute, requests_per_minute, max_concurrent ('' = no limit).
#: Returns {1, levels...} or {0, bucket index, reason, wait_s ('' for a slot), levels...}; levels: per bucket
#: tokens, requests, in flight, as strings.
ACQUIRE_LUA = _PRELUDE + """
local now = clock()
local tokens = tonumber(ARGV[2])
local member, lease, ttl_ms = ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5])
local n = #KEYS / 2
local st = {}
local best_i, best_reason, best_wait = nil, nil, nil
local function refuse(i, reason, wait)
  local w = wait or math.huge
  if best_i == nil or w > best_wait then best_i, best_reason, best_wait = i, reason, w end
end
for i = 1, n do
  local tpm, rpm, cap = tonumber(ARGV[5 + 3 * i - 2]), tonumber(ARGV[5 + 3 * i - 1]), tonumber(ARGV[5 + 3 * i])
  local tok, req, ts = load(KEYS[2 * i - 1], tpm, rpm, now)
  redis.call('ZREMRANGEBYSCORE', KEYS[2 * i], '-inf', now)
  local inflight = redis.call('ZCARD', KEYS[2 * i])
  if cap and inflight >= cap then refuse(i, 'max_concurrent', nil) end
  if tpm then
    local need = math.min(tokens, tpm)
    if tok < need then refuse(i, 'tokens_per_minute', (need - tok) / (tpm / 60)) end
  end
  if rpm then
    local need = math.min(1, rpm)
    if req < need then refuse(i, 'requests_per_minute', (need - req) / (rpm / 60)) end
  end
  st[i] = {tok, req, ts, inflight, tpm, rpm}
end
local out
if best_i then
  local wait = ''
  if best_wait ~= math.huge then wait = num(best_wait) end
  out = {0, best_i, best_reason, wait}
else
  out = {1}
  for i = 1, n do
    local s = st[i]
    if s[5] then s[1] = s[1] - math.min(tokens, s[5]) end
    if s[6] then s[2] = s[2] - math.min(1, s[6]) end
    redis.call('ZADD', KEYS[2 * i], now + lease, member)
    redis.call('PEXPIRE', KEYS[2 * i], math.floor(lease * 1000) + 1000)
    s[4] = s[4] + 1
  end
end
for i = 1, n do
  local s = st[i]
  save(KEYS[2 * i - 1], s[1], s[2], s[3], ttl_ms)
  table.insert(out, num(s[1])); table.insert(out, num(s[2])); table.insert(out, tostring(s[4]))
end
return out
"""

#: KEYS: per bucket, its hash and its slot set. ARGV: now, refund tokens, slot member ('' = none), bucket TTL (ms),
#: then per bucket tokens_per_minute, requests_per_minute. Returns 1.
RELEASE_LUA = _PRELUDE + """
local now = clock()
local refund, member, ttl_ms = tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4])
for i = 1, #KEYS / 2 do
  local tpm, rpm = tonumber(ARGV[4 + 2 * i - 1]), tonumber(ARGV[4 + 2 * i])
  local tok, req, ts = load(KEYS[2 * i - 1], tpm, rpm, now)
  if member ~= '' then redis.call('ZREM', KEYS[2 * i], member) end
  if refund > 0 and tpm then tok = math.min(tpm, tok + refund) end
  save(KEYS[2 * i - 1], tok, req, ts, ttl_ms)
end
return 1
"""

#: KEYS: slot sets; ARGV: now, lease (s), then one member per key. Extends the lease of each member still present
#: (an expired one is gone: ZADD XX does not bring it back). Returns how many were renewed.
RENEW_LUA = """
local now = ARGV[1]
if now == '' then local t = redis.call('TIME'); now = tonumber(t[1]) + tonumber(t[2]) / 1000000
else now = tonumber(now) end
local lease = tonumber(ARGV[2])
local renewed = 0
for i = 1, #KEYS do
  renewed = renewed + redis.call('ZADD', KEYS[i], 'XX', 'CH', now + lease, ARGV[2 + i])
  redis.call('PEXPIRE', KEYS[i], math.floor(lease * 1000) + 1000)
end
return renewed
"""


@dataclass(frozen=True)
class RedisGrant(Grant):
    """A Grant that says where the request was admitted: ``slot`` (its member in the slot sets) when in Redis,
    ``local`` True when by the fallback buckets."""

    slot: str | None = None
    local: bool = False


def _arg(value: float | int | None) -> str:
    return "" if value is None else repr(value)


class RedisLimits:
    """A LimitBackend in Redis (see the module docstring), with its fallback.

    Args:
        settings: ``balancer.quota`` (redis_url, key_prefix, timeouts, retry, slot lease).
        share: this balancer's share of every limit in the fallback, a number or a callable read at each use
            (1 / regions in membership); ``set_share`` pins a number (the controller's).
        client: a redis.asyncio client (default: one from ``settings.redis_url``).
        clock: the time given to the scripts instead of the server's ``TIME`` (tests of the arithmetic only).
    """

    #: The gate passes the Grant to ``release`` (the slot to free).
    takes_grant = True

    def __init__(self, settings: QuotaSettings, *, share: float | Callable[[], float] = 1.0,
                 client: aioredis.Redis | None = None, clock: Callable[[], float] | None = None):
        self.settings = settings
        self.prefix = settings.key_prefix
        self.client = client or aioredis.Redis.from_url(
            settings.redis_url, socket_connect_timeout=settings.redis_connect_timeout_s,
            socket_timeout=settings.redis_timeout_s, retry=Retry(NoBackoff(), 0))
        self._share = share
        self.fallback = LocalLimits(self.share_now())
        self.clock = clock
        self._acquire = self.client.register_script(ACQUIRE_LUA)
        self._release = self.client.register_script(RELEASE_LUA)
        self._renew = self.client.register_script(RENEW_LUA)
        self._instance = uuid.uuid4().hex[:12]
        self._ids = itertools.count()
        #: {bucket key: {slot member: None}} of the slots this balancer holds in Redis (renewed; insertion order).
        self.held: dict[str, dict[str, None]] = {}
        #: When Redis stopped answering (the caller's clock, s); None while it answers.
        self.fallback_since: float | None = None
        self._next_try = 0.0
        self._levels: dict[str, dict[str, float]] = {}
        #: Redis calls that failed (metrics, tests).
        self.failures = 0

    # -- the share of the fallback ----------------------------------------------------------------------------
    def share_now(self) -> float:
        """The share of every limit the fallback enforces now (0 < share <= 1)."""
        share = self._share() if callable(self._share) else self._share
        return min(1.0, max(1e-9, share))

    def set_share(self, share: float) -> None:
        """Enforce ``share`` of every limit while falling back, from now on (the controller's assignment)."""
        self._share = share
        self.fallback.set_share(self.share_now())

    @property
    def falling_back(self) -> bool:
        """True while Redis is unreachable and the fallback buckets count."""
        return self.fallback_since is not None

    # -- LimitBackend ----------------------------------------------------------------------------------------
    async def acquire(self, buckets: Sequence[tuple[str, Limit]], tokens: int, now: float) -> Grant:
        """See LimitBackend.acquire; in Redis, or in the fallback while Redis is unreachable."""
        if not buckets:
            return RedisGrant(True)
        if self._use_redis(now):
            member = f"{self._instance}:{next(self._ids)}"
            keys, args = [], [_arg(self.clock() if self.clock else None), str(int(tokens)), member,
                              repr(float(self.settings.slot_lease_s)), str(BUCKET_TTL_S * 1000)]
            for key, limit in buckets:
                keys += [f"{self.prefix}b:{key}", f"{self.prefix}s:{key}"]
                args += [_arg(limit.tokens_per_minute), _arg(limit.requests_per_minute), _arg(limit.max_concurrent)]
            try:
                reply = await self._call(self._acquire(keys=keys, args=args))
            except (RedisError, OSError, TimeoutError) as exc:
                self._failed(now, exc)
            else:
                self._recovered()
                return self._grant(buckets, reply, member)
        self.fallback.set_share(self.share_now())
        grant = self.fallback.acquire_now(buckets, tokens, now)
        return RedisGrant(grant.ok, grant.key, grant.reason, grant.wait_s, local=True)

    async def release(self, buckets: Sequence[tuple[str, Limit]], now: float, *, refund_tokens: int = 0,
                      grant: Grant | None = None) -> None:
        """See LimitBackend.release. ``grant`` (the one ``acquire`` returned) says where the slot is; without it,
        one slot this balancer holds in Redis on the first bucket is freed, else one of the fallback's."""
        if not buckets:
            return
        if grant is None:
            first = self.held.get(buckets[0][0])
            member = next(iter(first)) if first else None
            grant = RedisGrant(True, slot=member, local=member is None)
        if getattr(grant, "local", False):
            self.fallback.release_now(buckets, now, refund_tokens=refund_tokens)
            return
        member = getattr(grant, "slot", None) or ""
        for key, _ in buckets:
            self.held.get(key, {}).pop(member, None)
            if key in self.held and not self.held[key]:
                del self.held[key]
        if not self._use_redis(now):
            return  # its slot expires with its lease
        keys, args = [], [_arg(self.clock() if self.clock else None), str(int(refund_tokens)), member,
                          str(BUCKET_TTL_S * 1000)]
        for key, limit in buckets:
            keys += [f"{self.prefix}b:{key}", f"{self.prefix}s:{key}"]
            args += [_arg(limit.tokens_per_minute), _arg(limit.requests_per_minute)]
        try:
            await self._call(self._release(keys=keys, args=args))
        except (RedisError, OSError, TimeoutError) as exc:
            self._failed(now, exc)  # the slot expires with its lease
        else:
            self._recovered()

    def levels(self) -> dict[str, dict[str, float]]:
        """See LimitBackend.levels: the levels the latest acquire saw in Redis, or the fallback's while it counts."""
        if self.falling_back:
            return self.fallback.levels()
        return dict(self._levels)

    # -- upkeep -----------------------------------------------------------------------------------------------
    async def maintain(self, now: float) -> None:
        """Renew the leases of the slots held here; while falling back, try Redis again when it is time. Call
        every ``slot_lease_s / 3`` or more often (the balancer's quota loop)."""
        if self.falling_back:
            if now < self._next_try:
                return
            try:
                await self._call(self.client.ping())
            except (RedisError, OSError, TimeoutError) as exc:
                self._failed(now, exc)
                return
            self._recovered()
        pairs = [(f"{self.prefix}s:{key}", member) for key, members in self.held.items() for member in members]
        if not pairs:
            return
        try:
            await self._call(self._renew(keys=[k for k, _ in pairs],
                                         args=[_arg(self.clock() if self.clock else None),
                                               repr(float(self.settings.slot_lease_s)),
                                               *[m for _, m in pairs]]))
        except (RedisError, OSError, TimeoutError) as exc:
            self._failed(now, exc)

    async def close(self) -> None:
        """Close the connections to Redis."""
        await self.client.aclose()

    def _use_redis(self, now: float) -> bool:
        # While falling back, requests never wait on Redis: ``maintain`` (the upkeep loop) tries it again.
        return self.fallback_since is None

    async def _call(self, awaitable):
        # The client's own timeouts bound connect and read; this bounds the whole call (a pool wait included).
        async with asyncio.timeout(self.settings.redis_connect_timeout_s + self.settings.redis_timeout_s):
            return await awaitable

    def _failed(self, now: float, exc: BaseException) -> None:
        self.failures += 1
        self._next_try = now + self.settings.redis_retry_s
        if self.fallback_since is None:
            self.fallback_since = now
            log.warning("quota_redis_unreachable", error=f"{type(exc).__name__}: {exc}",
                        share=round(self.share_now(), 4), retry_s=self.settings.redis_retry_s)

    def _recovered(self) -> None:
        if self.fallback_since is not None:
            log.info("quota_redis_recovered")
            self.fallback_since = None

    def _grant(self, buckets: Sequence[tuple[str, Limit]], reply: list, member: str) -> RedisGrant:
        ok = int(reply[0]) == 1
        head = 1 if ok else 4
        for i, (key, _) in enumerate(buckets):
            tok, req, inflight = reply[head + 3 * i: head + 3 * i + 3]
            self._levels[key] = {"tokens": float(tok), "requests": float(req), "in_flight": float(inflight)}
        if ok:
            for key, limit in buckets:
                self.held.setdefault(key, {})[member] = None
            return RedisGrant(True, slot=member)
        index, reason, wait = int(reply[1]), _text(reply[2]), _text(reply[3])
        return RedisGrant(False, buckets[index - 1][0], reason, float(wait) if wait else None)


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)

