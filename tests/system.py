"""Real components the tests start (named, etcd, haproxy, redis-server): find them, or skip here and fail in CI.

deploy/system/install-packages.sh installs them (`make test` runs it). A developer's machine without one skips
the tests that need it; under CI (``CI=true``) a missing component fails the test, so CI always proves the real
thing.
"""

from __future__ import annotations

import os
import shutil

import pytest

__all__ = ["require_binary"]


def require_binary(name: str) -> str:
    """The path of executable ``name`` (PATH, then /usr/sbin and /usr/bin); skip, or fail when CI=true, if absent."""
    path = shutil.which(name) or next((p for d in ("/usr/sbin", "/usr/bin")
                                       if os.access(p := os.path.join(d, name), os.X_OK)), None)
    if path:
        return path
    message = f"{name} not installed (deploy/system/install-packages.sh installs it)"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message)
    pytest.skip(message)
