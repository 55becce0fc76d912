"""Under CI a test that needs a real component fails instead of skipping, whatever spelling of $CI the CI uses."""

from __future__ import annotations

import pytest

from tests.system import skip_or_fail, under_ci


def test_ci_is_recognised_in_every_spelling_ci_systems_use(monkeypatch):
    """CI=true (GitHub, GitLab), CI=1, CI=yes, any case: a test that needs a real component fails instead of
    skipping; unset, empty or false: it skips."""
    for value in ("true", "True", "1", " YES "):
        monkeypatch.setenv("CI", value)
        assert under_ci()
        with pytest.raises(pytest.fail.Exception):
            skip_or_fail("no llama-server here")
    for value in ("", "false", "0"):
        monkeypatch.setenv("CI", value)
        assert not under_ci()
        with pytest.raises(pytest.skip.Exception):
            skip_or_fail("no llama-server here")
