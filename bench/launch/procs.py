"""Child processes for the launcher and the tests: start them, wait until they answer, and always stop them.

Every process is started in its own session (process group) and killed with its whole group at teardown, so a
test that fails half-way leaves nothing running.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from bench.launch import forkstart, interrupts

__all__ = ["free_port", "free_port_block", "free_ports", "Proc", "ProcGroup", "wait_http"]



def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (see :func:`free_ports`)."""
    return free_ports(1)[0]


#: Ports handed out in the last RESERVE_S seconds by any process on this machine (pytest-xdist workers, their
#: children, `skylb local`): the OS may hand a port it just saw closed to the next bind(0), and a port is often
#: closed for a while between free_ports() and its server's bind (or between a server's stop and its restart).
RESERVED_PORTS_FILE = Path(tempfile.gettempdir()) / "skylb-reserved-ports"
RESERVE_S = 300.0


@contextlib.contextmanager
def _reservations() -> Iterator[dict[int, float]]:
    """The ports handed out on this machine in the last RESERVE_S seconds ({port: when}), under the reservation
    file's lock; what the block adds to the dict is written back at its end."""
    with open(RESERVED_PORTS_FILE, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
        f.seek(0)
        now = time.time()
        reserved = {}
        for line in f.read().split():  # "PORT@TIME"
            with contextlib.suppress(ValueError):
                port, at = line.split("@")
                if now - float(at) < RESERVE_S:
                    reserved[int(port)] = float(at)
        yield reserved
        f.seek(0)
        f.truncate()
        f.write("".join(f"{p}@{at:.1f}\n" for p, at in reserved.items()))


def free_port_block(n: int) -> int:
    """A port p with p .. p + n - 1 all free on 127.0.0.1 now and none handed out recently, reserved as
    :func:`free_ports` reserves (the emulator offsets each replica's KV-event ports from one: ``tcp://*:p`` for its
    first replica, p + 1 for the second, ...); RuntimeError when none is found."""
    with _reservations() as reserved:
        for _ in range(50):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                base = s.getsockname()[1]
            block = range(base, base + n)
            if any(p in reserved for p in block):
                continue
            socks = []
            try:
                for port in block:
                    sock = socket.socket()
                    socks.append(sock)
                    sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            finally:
                for sock in socks:
                    sock.close()
            now = time.time()
            reserved.update((p, now) for p in block)
            return base
    raise RuntimeError(f"no {n} consecutive free ports found")


def free_ports(n: int) -> list[int]:
    """n distinct free ports on 127.0.0.1, chosen by the OS and none handed out on this machine recently."""
    with _reservations() as reserved:
        ports: list[int] = []
        socks = []
        try:
            while len(ports) < n:
                s = socket.socket()
                s.bind(("127.0.0.1", 0))
                socks.append(s)  # held until all n are chosen, so the OS gives each port once
                port = s.getsockname()[1]
                if port not in reserved or len(socks) > 50 * n:
                    ports.append(port)
        finally:
            for s in socks:
                s.close()
        now = time.time()
        reserved.update((p, now) for p in ports)
    return ports


def wait_http(url: str, *, timeout_s: float = 20.0, proc: subprocess.Popen | None = None) -> None:
    """Poll ``url`` until it answers with any HTTP status below 500; raise TimeoutError after ``timeout_s``.

    Raises RuntimeError at once if ``proc`` exits first.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=1.0) as resp:
                if resp.status < 500:
                    return
        except urllib.error.HTTPError as exc:
            if exc.code < 500:
                return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not answer within {timeout_s} s")
        time.sleep(0.05)


def group_cpu_seconds(pgid: int) -> float:
    """CPU time (utime + stime over all threads, s) of the live processes in process group ``pgid``, from
    /proc/PID/stat (fields 14, 15 and 5 of proc(5)); 0 on a system without /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited while we looked
        # After the ")" closing the command: state(3) ppid(4) pgrp(5) ... utime(14) stime(15).
        if int(fields[2]) == pgid:
            total += int(fields[11]) + int(fields[12])
    return total / tick


class Proc:
    """One subprocess in its own process group; ``stop()`` kills the group (SIGTERM, then SIGKILL after 5 s)."""

    def __init__(self, args: list[str], *, name: str, log_dir: Path, env: dict[str, str] | None = None,
                 skylb_args: list[str] | None = None):
        """Start ``args``; with ``skylb_args`` (the arguments of a ``python -m skylb`` in ``args``) and
        :func:`bench.launch.forkstart.enable` called in this process, fork it from the preloaded server instead."""
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")
        full_env = {**os.environ, **(env or {})}
        self.popen: subprocess.Popen | forkstart.ForkedPopen
        if skylb_args is not None and forkstart.enabled():
            self.popen = forkstart.ForkedPopen(skylb_args, env=full_env, log_path=str(self.log_path))
        else:
            self.popen = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                          env=full_env)

    def cpu_seconds(self) -> float:
        """CPU time (user + system, all threads, s) used so far by the live processes of this process's group
        (it and the children it started); 0 for processes already gone. Read from /proc/PID/stat (proc(5))."""
        return group_cpu_seconds(self.popen.pid)

    def log(self) -> str:
        """Everything the process wrote so far (stdout and stderr)."""
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL the process and every child it started, at once (a crash: nothing gets to clean up)."""
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.popen.wait(timeout=5)

    def terminate(self) -> None:
        """Send SIGTERM to the process and every child it started, without waiting (``stop`` waits)."""
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass

    def stop(self) -> None:
        """Stop the process and every child it started; safe to call twice."""
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, signal.SIGTERM)
                self.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(timeout=5)
            except ProcessLookupError:
                pass
        else:
            try:  # children may outlive a leader that already exited
                os.killpg(self.popen.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self._log.close()


class ProcGroup:
    """A set of processes stopped together; use as a context manager (or a test fixture) so all are stopped.

    With ``pid_file``, the group keeps a file of "PID name" lines of every process it started.
    """

    def __init__(self, log_dir: Path, *, pid_file: Path | None = None):
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.pid_file = pid_file
        self.procs: list[Proc] = []

    def skylb(self, *args: str, name: str, wait_url: str | None = None, timeout_s: float = 20.0,
              env: dict[str, str] | None = None) -> Proc:
        """Start ``python -m skylb ARGS`` (forked from a preloaded server once :func:`bench.launch.forkstart.enable` was
        called in this process) and, when ``wait_url`` is given, wait until it answers."""
        return self.start([sys.executable, "-m", "skylb", *args], name=name, wait_url=wait_url,
                          timeout_s=timeout_s, env=env, skylb_args=list(args))

    def start(self, argv: list[str], *, name: str, wait_url: str | None = None, timeout_s: float = 20.0,
              env: dict[str, str] | None = None, skylb_args: list[str] | None = None) -> Proc:
        """Start any command; on a failed wait, raise with the process's log in the message. A Ctrl-C or SIGTERM
        arriving while the process starts takes effect once it is recorded here (bench/launch/interrupts.py), so the
        group's stop reaches it."""
        with interrupts.held():
            proc = Proc(argv, name=name, log_dir=self.log_dir, env=env, skylb_args=skylb_args)
            self.procs.append(proc)
            if self.pid_file is not None:  # lets an outside observer check that nothing outlives the group
                self.pid_file.write_text("".join(f"{p.popen.pid} {p.name}\n" for p in self.procs))
        if wait_url:
            try:
                wait_http(wait_url, timeout_s=timeout_s, proc=proc.popen)
            except (TimeoutError, RuntimeError) as exc:
                raise RuntimeError(f"{name}: {exc}\n--- log ---\n{proc.log()[-4000:]}") from exc
        return proc

    def cpu_seconds(self, prefix: str = "") -> float:
        """CPU time (s) used so far by the live processes started here whose name starts with ``prefix``."""
        return sum(p.cpu_seconds() for p in self.procs if p.name.startswith(prefix) and p.popen.poll() is None)

    def stop_all(self) -> None:
        """Stop every process started through this group: SIGTERM to all, newest first, then wait for each (a
        shutdown that waits for in-flight work overlaps the others': one after another, a test's teardown took
        seconds); a Ctrl-C or SIGTERM arriving meanwhile takes effect once all are stopped (bench/launch/interrupts.py)."""
        with interrupts.held():
            for proc in reversed(self.procs):
                proc.terminate()
            for proc in reversed(self.procs):
                proc.stop()

    def __enter__(self) -> "ProcGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()
