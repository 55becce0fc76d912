"""Ctrl-C and SIGTERM for the commands that start processes (`skylb local`, the live `skylb bench` runs): the first
signal ends the run, and the stop that follows runs to its end whatever signals arrive meanwhile.

An impatient user presses Ctrl-C, then again 0.3 s later; a service manager sends SIGTERM, then SIGINT. Python's
default turns each SIGINT into a KeyboardInterrupt wherever the main thread is, so the second one cuts the first
one's cleanup short (a traceback, and the processes not yet stopped keep running), and its default SIGTERM kills
the launcher at once, leaving every child (each in its own session, bench/launch/procs.py) behind. Here instead:

- :func:`stop_on_signals` makes SIGINT and SIGTERM raise one KeyboardInterrupt in the main thread, at the first
  signal; every later one is ignored: the stop is bounded (each process gets SIGTERM, then SIGKILL after 5 s).
- :func:`held`: a signal arriving inside the block takes effect at its end, so a process being started is recorded
  before the interrupt (and stopped with the others) and a stop under way is not cut; the main thread's blocks only
  (the handler runs there).
- :func:`stopping`: from here on the run is ending; signals are ignored (a command's final stop).

A process forked from the launcher (a process pool's worker) keeps Python's defaults: SIGINT raises there, SIGTERM
ends it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator

__all__ = ["stop_on_signals", "held", "stopping", "SIGNALS"]

#: The signals that stop a run.
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _State(threading.local):
    """Per thread: how deep in :func:`held` blocks it is and the signal deferred meanwhile (the handler runs in the
    main thread, so it reads the main thread's)."""

    holding = 0
    pending: int | None = None


_local = _State()
#: The process that installed the handler, and whether its run is ending (a signal came, or :func:`stopping`).
_owner: dict[str, int | bool | None] = {"pid": None, "ending": False}


def _interrupt(signum: int) -> None:
    _owner["ending"] = True
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def _on_signal(signum: int, _frame) -> None:
    if os.getpid() != _owner["pid"]:  # a forked worker: Python's defaults
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    if _owner["ending"]:
        return  # the run is ending: its stop is bounded and must finish
    if _local.holding:
        _local.pending = _local.pending or signum
        return
    _interrupt(signum)


def stop_on_signals() -> None:
    """From now on the first SIGINT or SIGTERM raises KeyboardInterrupt in the main thread and later ones are
    ignored (module docstring). Call it from the main thread of a command, before it starts processes."""
    _owner.update(pid=os.getpid(), ending=False)
    _local.holding, _local.pending = 0, None
    for signum in SIGNALS:
        signal.signal(signum, _on_signal)


@contextlib.contextmanager
def held() -> Iterator[None]:
    """A signal arriving inside the block raises its KeyboardInterrupt at the block's end instead (a no-op without
    :func:`stop_on_signals`)."""
    _local.holding += 1
    try:
        yield
    finally:
        _local.holding -= 1
        if not _local.holding and _local.pending is not None:
            signum, _local.pending = _local.pending, None
            if not _owner["ending"]:
                _interrupt(signum)


def stopping() -> None:
    """The run is ending (its final stop follows): every SIGINT and SIGTERM from now on is ignored, also while the
    interpreter exits (it puts Python-level handlers back to the default at exit, and the default ends the process
    by the signal: an impatient second Ctrl-C after a fast stop made the launcher exit by SIGINT instead of with
    status 130); the disposition is the operating system's ignore in the process that installed the handlers."""
    _owner["ending"] = True
    _local.pending = None
    if os.getpid() == _owner["pid"] and threading.current_thread() is threading.main_thread():
        for signum in SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
