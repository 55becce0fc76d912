"""Real components the tests start (named, etcd, haproxy, redis-server): find them, or skip here and fail in CI.

deploy/system/install-packages.sh installs them (`make test` runs it). A developer's machine without one skips
the tests that need it; under CI ($CI true, 1 or yes, any case) a missing component fails the test, so CI always
proves the real thing. :func:`under_ci` is the one place that reads $CI (tests/test_ci_components.py checks it).
"""

from __future__ import annotations

import os
import shutil

import pytest

__all__ = ["require_binary", "under_ci", "skip_or_fail", "CI_VALUES"]

#: Values of $CI that mean "this is CI" (any case): GitHub Actions and GitLab set "true", others "1" or "yes".
CI_VALUES = frozenset({"true", "1", "yes"})


def under_ci() -> bool:
    """True when $CI says this run is CI (:data:`CI_VALUES`, any case, surrounding blanks ignored)."""
    return os.environ.get("CI", "").strip().lower() in CI_VALUES


def skip_or_fail(message: str) -> None:
    """Skip the test with ``message`` on a developer's machine; fail it under CI, which must prove the real thing."""
    if under_ci():
        pytest.fail(f"CI={os.environ.get('CI')} but {message}")
    pytest.skip(message)


def require_binary(name: str) -> str:
    """The path of executable ``name`` (PATH, then /usr/sbin and /usr/bin); skip, or fail under CI, if absent."""
    path = shutil.which(name) or next((p for d in ("/usr/sbin", "/usr/bin")
                                       if os.access(p := os.path.join(d, name), os.X_OK)), None)
    if path:
        return path
    skip_or_fail(f"{name} not installed (deploy/system/install-packages.sh installs it)")
