"""The quota gate in one process: settings, token estimates, waiting, 429 with a jittered Retry-After, release."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from skylb.config import BalancerConfig
from skylb.quota.settings import QuotaSettings


def test_quota_settings_defaults_change_nothing():
    """Without a quota section there is no Redis, a 30 s wait and no quotas: the gate admits everything."""
    cfg = BalancerConfig()
    assert cfg.quota.redis_url is None and cfg.quota.wait_s == 30.0
    assert cfg.quotas.limits_for("default", "m") == []


def test_quota_settings_reject_unknown_keys_and_bad_urls():
    """A typo or a redis_url that is not a Redis URL is a validation error naming the key."""
    with pytest.raises(ValidationError, match="wait_seconds"):
        BalancerConfig.model_validate({"quota": {"wait_seconds": 3}})
    with pytest.raises(ValidationError, match="redis_url"):
        QuotaSettings(redis_url="http://127.0.0.1:6379")
    assert QuotaSettings(redis_url="redis://127.0.0.1:6379/0").redis_url.startswith("redis://")


def test_token_estimate_reads_max_tokens_in_each_api():
    """Prompt characters / 4 plus max_completion_tokens or max_tokens (times n), Ollama's options.num_predict, else
    the configured default; embeddings charge the prompt only."""
    from skylb.balancer.api import parse_ollama, parse_openai
    from skylb.quota.estimate import request_tokens

    def tokens(parsed, embedding=False):
        return request_tokens(parsed.text, parsed.max_tokens, embedding=embedding, default_max_tokens=100)

    body = b'{"model": "m", "prompt": "' + b"x" * 400 + b'", "max_tokens": 50, "n": 2}'
    assert tokens(parse_openai("/v1/completions", body, session_header_value=None)) == 100 + 100
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 7}'
    parsed = parse_openai("/v1/chat/completions", body, session_header_value=None)
    assert parsed.max_tokens == 7 and tokens(parsed) == -(-len("user: hi\n") // 4) + 7
    body = b'{"model": "m", "prompt": "' + b"y" * 40 + b'"}'
    assert tokens(parse_openai("/v1/completions", body, session_header_value=None)) == 10 + 100
    body = b'{"model": "m", "prompt": "' + b"y" * 40 + b'", "options": {"num_predict": 12}}'
    assert tokens(parse_ollama("/api/generate", body, session_header_value=None)) == 10 + 12
    body = b'{"model": "m", "prompt": "hello", "options": {"num_predict": -1}}'
    assert parse_ollama("/api/generate", body, session_header_value=None).max_tokens is None
    body = b'{"model": "m", "input": "' + b"z" * 80 + b'"}'
    assert tokens(parse_openai("/v1/embeddings", body, session_header_value=None), embedding=True) == 20


# --- the gate, in one process (LocalLimits) --------------------------------------------------------------------

import asyncio  # noqa: E402
import random  # noqa: E402

from skylb.quota.buckets import LocalLimits  # noqa: E402
from skylb.quota.gate import QuotaExceeded, QuotaGate, retry_after_s  # noqa: E402
from skylb.quota.limits import Limit, Quotas, TenantQuota  # noqa: E402


def _gate(quotas: Quotas, limits: LocalLimits | None = None) -> tuple[QuotaGate, dict]:
    box = {"quotas": quotas, "limits": limits or LocalLimits()}
    loop = asyncio.get_running_loop()
    gate = QuotaGate(quotas=lambda: box["quotas"], limits=lambda: box["limits"], now=loop.time,
                     rng=random.Random(1))
    return gate, box


def _tenant(**limit) -> Quotas:
    return Quotas(tenants={"a": TenantQuota(limits={"m": Limit(**limit)})})


def test_gate_without_quotas_admits_at_once():
    """No limit for the tenant or model: admit returns None at once and nothing is counted."""
    async def main():
        gate, _ = _gate(Quotas())
        assert await gate.admit("a", "m", 10**9, deadline=0.0) is None
        gate.release(None)
    asyncio.run(main())


def test_gate_over_tokens_per_minute_waits_then_raises_with_refill_retry_after():
    """A request over its tokens-per-minute bucket waits until its deadline, then QuotaExceeded names the limit and
    carries a Retry-After from the refill time (30 s for 300 tokens at 600/min, up to 1.5x, whole seconds)."""
    async def main():
        gate, box = _gate(_tenant(tokens_per_minute=600))
        loop = asyncio.get_running_loop()
        first = await gate.admit("a", "m", 600, deadline=loop.time())
        assert first is not None and first.tokens == 600
        waiter = asyncio.create_task(gate.admit("a", "m", 300, deadline=loop.time() + 0.3))
        await asyncio.sleep(0.1)
        assert gate.waiting_now() == {"a": 1}
        try:
            await waiter
        except QuotaExceeded as exc:
            assert exc.reason == "tokens_per_minute" and exc.key == "tenant/a/m"
            assert 27 <= exc.retry_after_s <= 45, exc.retry_after_s
        else:
            raise AssertionError("admitted over the limit")
        assert gate.waiting_now() == {}
        assert await gate.admit("b", "m", 10**6, deadline=loop.time()) is None  # another tenant: no limit
    asyncio.run(main())


def test_gate_wakes_a_waiter_when_a_slot_is_released():
    """At a concurrency cap, a waiting request is admitted when the holder releases (an event, not a poll), and a
    second release of the same admission does nothing."""
    async def main():
        gate, box = _gate(_tenant(max_concurrent=1))
        loop = asyncio.get_running_loop()
        holder = await gate.admit("a", "m", 1, deadline=loop.time())
        waiter = asyncio.create_task(gate.admit("a", "m", 1, deadline=loop.time() + 10))
        await asyncio.sleep(0.05)
        assert not waiter.done() and gate.waiting_now() == {"a": 1}
        gate.release(holder)
        gate.release(holder)
        second = await asyncio.wait_for(waiter, 0.5)  # MAX_SLEEP_S is 1 s: only the release event can be this quick
        assert box["limits"].levels()["tenant/a/m"]["in_flight"] == 1
        gate.release(second)
        assert box["limits"].levels()["tenant/a/m"]["in_flight"] == 0
    asyncio.run(main())


def test_gate_concurrency_retry_after_follows_recent_durations():
    """At a concurrency cap the Retry-After is the expected release of the oldest slot: the bucket's recent mean
    duration (about 3 s here) less the time the holder has run, jittered, at least 1 s."""
    async def main():
        gate, _ = _gate(_tenant(max_concurrent=1))
        loop = asyncio.get_running_loop()
        gate._durations["tenant/a/m"].extend([3.0, 3.0])
        holder = await gate.admit("a", "m", 1, deadline=loop.time())
        with pytest.raises(QuotaExceeded) as info:
            await gate.admit("a", "m", 1, deadline=loop.time() + 0.05)
        assert info.value.reason == "max_concurrent" and 3 <= info.value.retry_after_s <= 5
        gate.release(holder)
    asyncio.run(main())


def test_gate_cancelled_waiter_holds_nothing():
    """A waiting request whose client left (cancelled) stops waiting and holds no slot."""
    async def main():
        gate, box = _gate(_tenant(max_concurrent=1))
        loop = asyncio.get_running_loop()
        holder = await gate.admit("a", "m", 1, deadline=loop.time())
        waiter = asyncio.create_task(gate.admit("a", "m", 1, deadline=loop.time() + 10))
        await asyncio.sleep(0.05)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert gate.waiting_now() == {}
        gate.release(holder)
        assert box["limits"].levels()["tenant/a/m"]["in_flight"] == 0
    asyncio.run(main())


def test_gate_reads_quotas_on_every_request():
    """A limit raised while a request waits lets it in; a limit removed lets it pass without a charge."""
    async def main():
        gate, box = _gate(_tenant(requests_per_minute=1))
        loop = asyncio.get_running_loop()
        await gate.admit("a", "m", 1, deadline=loop.time())
        waiter = asyncio.create_task(gate.admit("a", "m", 1, deadline=loop.time() + 10))
        await asyncio.sleep(0.05)
        box["quotas"] = Quotas()
        gate.wake_all()
        assert await asyncio.wait_for(waiter, 0.5) is None
    asyncio.run(main())


def test_retry_after_is_jittered_up_to_half_again_and_whole_seconds():
    """Retry-After spreads uniformly over [base, 1.5 x base], rounds up to whole seconds (RFC 9110 delay-seconds),
    and is never below 1 s."""
    rng = random.Random(7)
    values = [retry_after_s(100.0, rng) for _ in range(200)]
    assert min(values) >= 100 and max(values) <= 150 and len(set(values)) > 20
    assert sum(v > 125 for v in values) > 50 and sum(v <= 125 for v in values) > 50  # spread over the range
    assert retry_after_s(0.0, rng) == 1 and retry_after_s(0.2, rng) == 1


def test_queue_503_retry_after_follows_the_dispatch_rate():
    """A queue 503's Retry-After is (queued + 1) / dispatch rate, jittered, whole seconds, capped by the queue
    timeout; without a recent rate it is the configured retry_after_s, jittered."""
    from types import SimpleNamespace

    from skylb.balancer.retry_after import queue_retry_after_s

    def router(rate, queued):
        return SimpleNamespace(dispatch_rate=lambda now: rate, queue=[None] * queued)

    rng = random.Random(3)
    assert 5 <= queue_retry_after_s(router(None, 50), 0.0, default_s=5, max_s=600, rng=rng) <= 8
    assert 10 <= queue_retry_after_s(router(2.0, 19), 0.0, default_s=5, max_s=600, rng=rng) <= 15
    assert queue_retry_after_s(router(0.01, 1000), 0.0, default_s=5, max_s=30, rng=rng) == 30
    assert queue_retry_after_s(router(100.0, 0), 0.0, default_s=5, max_s=30, rng=rng) == 1


def test_a_forwarded_request_is_not_charged_again():
    """A request a peer forwarded (charged at the balancer it arrived at) passes the gate without a charge, even
    when its tenant's bucket is empty here; a client's request is charged prompt plus max_tokens."""
    async def main():
        gate, box = _gate(_tenant(tokens_per_minute=100))
        loop = asyncio.get_running_loop()
        kw = dict(tenant="a", model="m", text="x" * 40, max_tokens=90, path="/v1/completions")
        first = await gate.admit_request(**kw, arrived_at=loop.time(), forwarded=False)
        assert first.tokens == 100 and box["limits"].levels()["tenant/a/m"]["tokens"] == 0
        assert await gate.admit_request(**kw, arrived_at=loop.time(), forwarded=True) is None
        assert box["limits"].levels()["tenant/a/m"]["in_flight"] == 1
        gate.release(first)
    asyncio.run(main())
