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
    assert parsed.max_tokens == 7 and tokens(parsed) == len("user: hi\n") // 4 + 7
    body = b'{"model": "m", "prompt": "' + b"y" * 40 + b'"}'
    assert tokens(parse_openai("/v1/completions", body, session_header_value=None)) == 10 + 100
    body = b'{"model": "m", "prompt": "' + b"y" * 40 + b'", "options": {"num_predict": 12}}'
    assert tokens(parse_ollama("/api/generate", body, session_header_value=None)) == 10 + 12
    body = b'{"model": "m", "prompt": "hello", "options": {"num_predict": -1}}'
    assert parse_ollama("/api/generate", body, session_header_value=None).max_tokens is None
    body = b'{"model": "m", "input": "' + b"z" * 80 + b'"}'
    assert tokens(parse_openai("/v1/embeddings", body, session_header_value=None), embedding=True) == 20
