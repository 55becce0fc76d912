"""Shared fixtures: a ProcGroup per test whose processes are always stopped, even when the test fails."""

from __future__ import annotations

import pytest

from tests.procs import ProcGroup


@pytest.fixture
def procs(tmp_path):
    """A ProcGroup logging to the test's tmp dir; every process it started is stopped at teardown."""
    group = ProcGroup(tmp_path / "logs")
    try:
        yield group
    finally:
        group.stop_all()
