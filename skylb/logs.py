"""One logging set-up for every SkyLB process: structlog, one JSON object per line.

Each line carries ``event`` (what happened, snake_case), ``level``, ``timestamp`` (ISO 8601, UTC), ``logger`` (the
name given to ``structlog.get_logger``, e.g. ``skylb.balancer.membership``), the context bound with
``structlog.contextvars.bind_contextvars`` (a balancer binds its ``region`` once at start, so every line it writes
names it) and the event's own fields; a logged exception adds ``exception`` (the formatted traceback). Machines
(journald, Kubernetes, the benchmark harness) read the lines, so every process writes the same shape to the same
stream: stderr, which also keeps stdout free for what a command prints for people or pipes.

The lowest level written is ``--log-level`` (:func:`add_arguments`), else ``$SKYLB_LOG_LEVEL``, else info.

The standard library's logging (aiohttp's "Error handling request" and "Unhandled exception", asyncio's, any
library's) goes through the same JSON renderer: one handler on the root logger with structlog's
``ProcessorFormatter`` (structlog docs, "Standard Library Logging": rendering foreign records with structlog-based
formatters), so such a line is one JSON object too, with its logger's name and its traceback as ``exception``
(warning and above, or the level if higher).
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any, TextIO

import structlog

from skylb import environment

__all__ = ["configure_logging", "add_arguments", "LEVELS", "DEFAULT_LEVEL"]

#: The level names ``--log-level`` and ``$SKYLB_LOG_LEVEL`` accept (any case).
LEVELS = ("debug", "info", "warning", "error", "critical")
#: The level written when neither ``--log-level`` nor ``$SKYLB_LOG_LEVEL`` says one.
DEFAULT_LEVEL = "info"


#: This process's standard output when the module was loaded: a logger given it writes to ``sys.stdout`` as it is
#: at each line (which a test may have replaced), as structlog's PrintLogger does.
_STDOUT = sys.stdout


class _NamedPrintLogger(structlog.PrintLogger):
    """structlog's PrintLogger that keeps the name it was created with, as ``logging.Logger`` does, and writes each
    line with its newline in one write (``print`` makes two, each a system call on stderr, which is unbuffered)."""

    def __init__(self, file: TextIO, name: str | None) -> None:
        super().__init__(file)
        self.name = name

    def msg(self, message: str) -> None:
        """Write ``message`` as one line and flush."""
        out = sys.stdout if self._file is _STDOUT else self._file
        with self._lock:
            out.write(message + "\n")
            out.flush()


def _add_logger_name(logger: Any, method_name: str, event_dict: dict) -> dict:
    """Put the logger's name in the line as ``logger`` (structlog.stdlib.add_logger_name for our PrintLogger);
    a logger created without a name adds nothing."""
    name = getattr(logger, "name", None)
    if name:
        event_dict.setdefault("logger", name)
    return event_dict


def _level_number(level: int | str | None) -> int:
    if level is None:
        level = environment.env(environment.LOG_LEVEL) or DEFAULT_LEVEL
    if isinstance(level, int):
        return level
    number = logging.getLevelNamesMapping().get(level.strip().upper())
    if number is None:
        raise ValueError(f"unknown log level {level!r} (one of: {', '.join(LEVELS)})")
    return number


def configure_logging(*, level: int | str | None = None, file: TextIO | None = None) -> None:
    """Send every structlog logger of this process to ``file`` (default: stderr), one JSON object per line.

    ``level`` is the lowest level written, as a ``logging`` number or a name such as "info"; None: the level
    ``$SKYLB_LOG_LEVEL`` names, else info. Call it once at process start-up, before the first line is logged:
    loggers are cached on first use, so a logger used before the call keeps the previous set-up. Raises ValueError
    for an unknown level name (also one from the environment).
    """
    number = _level_number(level)
    out = file or sys.stderr
    timestamper = structlog.processors.TimeStamper(fmt="iso", utc=True)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            _add_logger_name,
            timestamper,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(number),
        logger_factory=lambda name=None, *_: _NamedPrintLogger(out, name),
        cache_logger_on_first_use=True,
    )
    _route_standard_logging(out, number, timestamper)


class _StructlogHandler(logging.StreamHandler):
    """The root logger's handler that ``configure_logging`` installs (a later call replaces it, not adds one)."""


def _route_standard_logging(out: TextIO, number: int, timestamper: Any) -> None:
    """Write the standard library's records to ``out``, rendered as structlog's lines are (``ProcessorFormatter``
    with a ``foreign_pre_chain``), at warning and above or ``number`` if higher, as Python's own last-resort handler
    did: libraries' info lines (httpx logs one per request) are not SkyLB's events."""
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[
            structlog.contextvars.merge_contextvars,
            structlog.stdlib.add_log_level,
            structlog.stdlib.add_logger_name,
            timestamper,
        ],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
    )
    handler = _StructlogHandler(out)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _StructlogHandler)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(max(number, logging.WARNING))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--log-level`` to a process's command line (pass ``args.log_level`` to :func:`configure_logging`)."""
    parser.add_argument("--log-level", type=str.lower, choices=LEVELS, default=None, metavar="LEVEL",
                        help=f"lowest log level written: {', '.join(LEVELS)} (default: ${environment.LOG_LEVEL.name}, "
                             f"else {DEFAULT_LEVEL})")
