"""A real etcd server on loopback for the tests (Debian's etcd-server; deploy/system/install-packages.sh).

One single-member cluster on free ports with its data in a temporary directory, started by ``start_etcd`` and
always stopped (its process group killed) when the ``with`` block ends, also on failure.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from tests.procs import ProcGroup, free_ports
from tests.system import require_binary

__all__ = ["start_etcd"]


@contextlib.contextmanager
def start_etcd(tmp: Path) -> Iterator[str]:
    """Run etcd with its data and log under ``tmp`` until the block ends; yields its client URL once healthy.

    Skips the test when etcd is not installed (fails under CI=true, tests/system.py).
    """
    etcd = require_binary("etcd")
    client, peer = (f"http://127.0.0.1:{port}" for port in free_ports(2))
    argv = [etcd, "--name", "n1", "--data-dir", str(tmp / "data"),
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer, "--initial-cluster", f"n1={peer}"]
    with ProcGroup(tmp / "logs") as group:
        # /health answers 503 until the member has elected itself and applied its first entries.
        group.start(argv, name="etcd", wait_url=f"{client}/health", timeout_s=30)
        yield client
