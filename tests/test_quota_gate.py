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
