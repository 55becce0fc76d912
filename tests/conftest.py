"""Shared fixtures: a ProcGroup per test whose processes are always stopped, even when the test fails."""

from __future__ import annotations

import pytest

from tests.procs import ProcGroup


@pytest.fixture
def procs(tmp_path):
    """A ProcGroup logging to the test's tmp dir; every process it started is stopped at teardown.

    Before that, the checks registered in ``group.teardown_checks`` run (a Cluster registers one: the counters of
    its balancers still running return to zero); the first that fails fails the test at teardown."""
    group = ProcGroup(tmp_path / "logs")
    group.teardown_checks = []
    failure = None
    try:
        yield group
    finally:
        for check in group.teardown_checks:
            try:
                check()
            except AssertionError as exc:
                failure = failure or exc
        group.stop_all()
    if failure is not None:
        raise failure


@pytest.fixture(scope="session")
def etcd(tmp_path_factory):
    """The client URL of a real etcd shared by the session's tests (tests/etcd.py); each test keeps its data under a
    key prefix of its own."""
    from tests.etcd import start_etcd

    with start_etcd(tmp_path_factory.mktemp("etcd")) as url:
        yield url
