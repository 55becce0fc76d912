"""Start `skylb` processes by forking a server that has already imported them, for the test suite.

A balancer, controller or emulator started as ``python -m skylb ...`` spends about 1 s of CPU importing aiohttp,
pydantic, the config schema and the routing core before it serves (the suite starts about 500 of them on 2 cores).
Forked from a process that imported those modules once, the same process starts in about 0.06 s of CPU. The child is
still a process of its own running the real ``skylb`` command line (:func:`skylb.cli.main`) with the argv, the
environment, the working directory and the log file it would have had; what it skips is only the interpreter's start
and the imports (the import of every module is covered by the tests that run ``python -m skylb`` itself: ``--help``
of each subcommand, `skylb local`, whose children are exec'd).

The server is the standard library's ``multiprocessing`` forkserver ("Contexts and start methods" in the
``multiprocessing`` docs): started once per process that calls :func:`enable` (one per pytest-xdist worker), it
imports :data:`PRELOAD` and forks each child, and tells the parent its pid and exit status. The forkserver resets
the signal handlers it changed, closes its own descriptors in the child and passes exit statuses as negative
signal numbers as :class:`subprocess.Popen` does, so :class:`ForkedPopen` behaves like a Popen for
:class:`bench.launch.procs.Proc`. Modules must not read the environment when imported (they are imported once, in the
server); the product and the harness read it in ``main`` (checked by the suite: every test's processes get their
own environment this way).
"""

from __future__ import annotations

import io
import multiprocessing
import os
import signal
import subprocess
import sys
import time

__all__ = ["PRELOAD", "enable", "enabled", "disable", "ForkedPopen"]

#: What the server imports once: the subcommands the tests start by the hundred (others import in the child).
PRELOAD = ["skylb.cli", "skylb.balancer.process", "controller.server", "bench.emulator.server",
           "bench.latency.server"]

_context: multiprocessing.context.BaseContext | None = None


def enable(preload: list[str] | None = None) -> None:
    """Start later ``skylb`` processes of this process (``ProcGroup.skylb``) by fork from a preloaded server; the
    server itself starts at the first such process. Idempotent."""
    global _context
    if _context is None:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(list(PRELOAD if preload is None else preload))
        _context = context


def disable() -> None:
    """Go back to exec'ing ``python -m skylb`` (the server, if started, stays until this process exits)."""
    global _context
    _context = None


def enabled() -> bool:
    """Whether ``ProcGroup.skylb`` forks its processes."""
    return _context is not None


def _run_skylb(args: list[str], env: dict[str, str], cwd: str, log_path: str) -> None:
    """The child: its own session, stdout and stderr to ``log_path``, ``env`` as its whole environment, then the
    `skylb` command line; exits with its status (SystemExit, handled by multiprocessing as the interpreter does)."""
    os.setsid()  # as Popen(start_new_session=True): its own process group, killed as one
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    # The streams a fresh interpreter would open on a file (PYTHONUNBUFFERED honoured; stderr line-buffered).
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    sys.stdout = _text_stream(1, unbuffered, line_buffering=False, errors="strict")
    sys.stderr = _text_stream(2, unbuffered, line_buffering=True, errors="backslashreplace")
    import skylb.cli
    sys.argv = [os.path.join(os.path.dirname(skylb.cli.__file__), "__main__.py"), *args]
    try:
        sys.exit(skylb.cli.main(args))
    finally:
        import atexit
        atexit._run_exitfuncs()  # an interpreter's exit runs them; multiprocessing's child exit does not


def _text_stream(fd: int, unbuffered: bool, *, line_buffering: bool, errors: str) -> io.TextIOWrapper:
    raw = io.FileIO(fd, "w", closefd=False)
    binary = raw if unbuffered else io.BufferedWriter(raw)
    return io.TextIOWrapper(binary, encoding="utf-8", errors=errors, line_buffering=line_buffering,
                            write_through=unbuffered)


class ForkedPopen:
    """The part of :class:`subprocess.Popen` that :class:`bench.launch.procs.Proc` and the tests use (pid, poll, wait,
    send_signal, terminate, kill, returncode), for one ``skylb ARGS`` process forked from the server.

    Raises RuntimeError (the child killed) if it has not made its own process group within 10 s."""

    def __init__(self, args: list[str], *, env: dict[str, str], log_path: str):
        assert _context is not None, "bench.launch.forkstart.enable() first"
        self.args = ["skylb", *args]
        self._process = _context.Process(target=_run_skylb, args=(list(args), dict(env), os.getcwd(), log_path),
                                          name=f"skylb {' '.join(args[:1])}")
        self._process.start()
        self.pid: int = self._process.pid
        # Popen(start_new_session=True) returns after setsid; here the child does it: wait, so that killpg reaches it.
        deadline = time.monotonic() + 10.0
        while self.poll() is None and _pgid(self.pid) != self.pid:
            if time.monotonic() > deadline:
                self.kill()  # not in any group yet: nothing else would stop it
                raise RuntimeError(f"forked {self.args} did not start its own process group within 10 s")
            time.sleep(0.001)

    @property
    def returncode(self) -> int | None:
        """The exit status once known (negative: killed by that signal), else None."""
        return self._process.exitcode

    def poll(self) -> int | None:
        """The exit status if the process has ended, else None."""
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the end and return the exit status; subprocess.TimeoutExpired after ``timeout`` s."""
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` to the process (nothing if it has ended)."""
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        """SIGTERM the process (not its group: :class:`bench.launch.procs.Proc` signals the group)."""
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL the process (not its group)."""
        self.send_signal(signal.SIGKILL)


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None
