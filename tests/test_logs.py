"""skylb.logs: the one log format every SkyLB process writes (one JSON object per line)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest
import structlog

from skylb.logs import configure_logging


ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def buffer():
    """A buffer to log into; structlog's defaults come back afterwards, so later tests find it as they left it."""
    yield io.StringIO()
    structlog.reset_defaults()


def lines(buffer: io.StringIO) -> list[dict]:
    """The JSON objects written to ``buffer`` so far, one per line (a line that is not JSON fails the test)."""
    return [json.loads(line) for line in buffer.getvalue().splitlines()]


def test_one_json_object_per_line_with_event_level_and_utc_timestamp(buffer):
    """Each call writes one line: a JSON object with event, level, an ISO 8601 UTC timestamp and the fields."""
    configure_logging(file=buffer)
    log = structlog.get_logger("test")
    log.info("replica_added", region="us", revision=3)
    log.warning("probe_failed", reason="connection refused")
    first, second = lines(buffer)
    assert first.keys() == {"event", "level", "timestamp", "region", "revision"}
    assert (first["event"], first["level"], first["region"], first["revision"]) == ("replica_added", "info", "us", 3)
    assert (second["event"], second["level"]) == ("probe_failed", "warning")
    assert datetime.fromisoformat(first["timestamp"]).utcoffset().total_seconds() == 0


def test_exception_is_formatted_into_the_line(buffer):
    """log.exception adds the traceback as a string field, still on one JSON line."""
    configure_logging(file=buffer)
    try:
        raise ValueError("bad gauge")
    except ValueError:
        structlog.get_logger("test").exception("request_failed", path="/v1/completions")
    (line,) = lines(buffer)
    assert (line["event"], line["level"]) == ("request_failed", "error")
    assert line["exception"].startswith("Traceback") and "ValueError: bad gauge" in line["exception"]


@pytest.mark.parametrize("level", ["warning", "WARNING", 30])
def test_level_drops_lower_levels(buffer, level):
    """A level (name in any case, or logging number) drops lines below it and keeps the rest."""
    configure_logging(level=level, file=buffer)
    log = structlog.get_logger("test")
    log.debug("hidden")
    log.info("hidden")
    log.warning("shown")
    log.error("shown")
    assert [line["level"] for line in lines(buffer)] == ["warning", "error"]


def test_every_level_is_written_by_default(buffer):
    """Without a level, debug lines are written too (the processes filter nothing today)."""
    configure_logging(file=buffer)
    structlog.get_logger("test").debug("detail")
    assert [line["event"] for line in lines(buffer)] == ["detail"]


def test_unknown_level_name_is_refused():
    """A misspelt level name raises ValueError naming it, before anything is configured."""
    with pytest.raises(ValueError, match="'verbose'"):
        configure_logging(level="verbose")


def test_a_process_logs_to_stderr_not_stdout():
    """By default the lines go to stderr, so a process's stdout stays free for what it prints."""
    code = ("import structlog; from skylb.logs import configure_logging; configure_logging(); "
            "structlog.get_logger('x').info('started', port=1)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 0 and proc.stdout == ""
    (line,) = [json.loads(text) for text in proc.stderr.splitlines()]
    assert (line["event"], line["port"]) == ("started", 1)
