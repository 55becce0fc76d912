"""A real redis-server on loopback for the tests (Debian's redis-server; deploy/system/install-packages.sh).

Started by ``start_redis`` on a free port with no persistence and its files in a temporary directory, and always
stopped (its process group killed) when the ``with`` block ends, also on failure. ``RedisServer.stop`` stops it
earlier (a test of the fallback), ``start`` brings it back on the same port.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from tests.procs import Proc, ProcGroup, free_port
from tests.system import require_binary

__all__ = ["start_redis", "RedisServer"]


def _wait_port(port: int, proc: Proc, timeout_s: float = 10.0) -> None:
    """Wait until redis answers PING on ``port``; raise RuntimeError with its log if it exits or never does."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            break
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(64).startswith(b"+PONG"):
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"redis-server did not answer on port {port}\n--- log ---\n{proc.log()[-3000:]}")


class RedisServer:
    """One redis-server process under ``group``; ``url`` stays the same across ``stop`` and ``start``."""

    def __init__(self, group: ProcGroup, tmp: Path):
        self.binary = require_binary("redis-server")
        self.group, self.tmp = group, tmp
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: Proc | None = None
        self._starts = 0

    def start(self) -> None:
        """Start redis-server (no RDB, no AOF) and wait until it answers PING."""
        self._starts += 1
        argv = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(self.tmp), "--protected-mode", "yes"]
        self.proc = self.group.start(argv, name=f"redis-{self._starts}")
        _wait_port(self.port, self.proc)

    def stop(self) -> None:
        """Kill redis-server now (SIGKILL: an outage, not a shutdown)."""
        if self.proc is not None:
            self.proc.kill()
            self.proc = None


@contextlib.contextmanager
def start_redis(tmp: Path) -> Iterator[RedisServer]:
    """Run redis-server until the block ends; yields the RedisServer once it answers.

    Skips the test when redis-server is not installed (fails under CI=true, tests/system.py).
    """
    with ProcGroup(tmp / "redis-logs") as group:
        server = RedisServer(group, tmp)
        server.start()
        yield server
