"""Under CI a test that needs a real component fails instead of skipping, whatever spelling of $CI the CI uses."""

from __future__ import annotations

import re
from pathlib import Path

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


def test_only_the_helper_reads_ci():
    """Every skip-or-fail decision goes through tests/system.py's under_ci(): no other module in tests/, bench/,
    skylb/ or controller/ reads $CI (os.environ["CI"], os.environ.get("CI"), os.getenv("CI"), "CI" in os.environ;
    this file aside, which names them)."""
    root = Path(__file__).resolve().parents[1]
    reads = re.compile(r"""environ(\.get)?\s*[\[(]\s*["']CI["']|getenv\(\s*["']CI["']|["']CI["']\s+in\s+os\.environ""")
    readers = sorted(str(path.relative_to(root)) for folder in ("tests", "bench", "skylb", "controller")
                     for path in (root / folder).rglob("*.py")
                     if path != Path(__file__).resolve() and reads.search(path.read_text(encoding="utf-8")))
    assert readers == ["tests/system.py"]
