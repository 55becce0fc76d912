"""One logging set-up for every SkyLB process: structlog, one JSON object per line.

Each line carries ``event`` (what happened, snake_case), ``level``, ``timestamp`` (ISO 8601, UTC) and the event's
own fields; a logged exception adds ``exception`` (the formatted traceback). Machines (journald, Kubernetes, the
benchmark harness) read the lines, so every process writes the same shape to the same stream: stderr, which also
keeps stdout free for what a command prints for people or pipes.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog

__all__ = ["configure_logging"]


def configure_logging(*, level: int | str = logging.DEBUG, file: TextIO | None = None) -> None:
    """Send every structlog logger of this process to ``file`` (default: stderr), one JSON object per line.

    ``level`` is the lowest level written, as a ``logging`` number or a name such as "info" (default: every
    level). Call it once at process start-up, before the first line is logged: loggers are cached on first use,
    so a logger used before the call keeps the previous set-up. Raises ValueError for an unknown level name.
    """
    if isinstance(level, str):
        number = logging.getLevelNamesMapping().get(level.upper())
        if number is None:
            raise ValueError(f"unknown log level {level!r} (one of: debug, info, warning, error, critical)")
        level = number
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=file or sys.stderr),
        cache_logger_on_first_use=True,
    )
