"""Shared fixtures: a ProcGroup per test whose processes are always stopped, even when the test fails; a real etcd;
the membership stores of each backend (``reopen``)."""

from __future__ import annotations

import os
import uuid

import pytest

from bench.launch import forkstart
from tests.procs import ProcGroup

# The balancers, controllers and emulators the tests start (hundreds) are forked from a server that imported them
# once (bench/launch/forkstart.py): about 0.06 s of CPU each instead of 1 s. SKYLB_TEST_EXEC=1 exec's each one instead.
if not os.environ.get("SKYLB_TEST_EXEC"):
    forkstart.enable()


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


@pytest.fixture(params=["sqlite", "etcd"])
def reopen(request, tmp_path):
    """Opens a store of each backend, always the same one (a SQLite file, an etcd key prefix); all closed at the
    end. etcd's tests share one real etcd server (the session's ``etcd`` fixture)."""
    from controller.etcd_store import EtcdMembershipStore
    from controller.store import MembershipStore

    if request.param == "sqlite":
        def open_store():
            return MembershipStore(tmp_path / "new-dir" / "m.sqlite")  # "new-dir": the store creates it
    else:
        endpoint, prefix = request.getfixturevalue("etcd"), f"/test/{uuid.uuid4().hex}"

        def open_store():
            return EtcdMembershipStore([endpoint], prefix=prefix)
    opened = []
    yield lambda: opened.append(open_store()) or opened[-1]
    for store in opened:
        store.close()
