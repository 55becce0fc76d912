"""skylb.logs: the one log format every SkyLB process writes (one JSON object per line)."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
import time
import urllib.error
import urllib.request
from datetime import datetime
from pathlib import Path

import pytest
import requests
import structlog

from skylb.logs import configure_logging
from tests.cluster import Cluster
from tests.procs import free_ports


ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def buffer():
    """A buffer to log into; structlog's defaults and the root logger's handlers and level come back afterwards, so
    later tests find them as they left them."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield io.StringIO()
    structlog.reset_defaults()
    root.handlers[:] = handlers
    root.setLevel(level)


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
    assert first.keys() == {"event", "level", "timestamp", "logger", "region", "revision"}
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


def test_info_is_the_default_level(buffer, monkeypatch):
    """Without a level or $SKYLB_LOG_LEVEL, debug lines are dropped and info lines written."""
    monkeypatch.delenv("SKYLB_LOG_LEVEL", raising=False)
    configure_logging(file=buffer)
    log = structlog.get_logger("test")
    log.debug("detail")
    log.info("started")
    assert [line["event"] for line in lines(buffer)] == ["started"]


def test_level_from_the_environment_and_the_argument_wins(buffer, monkeypatch):
    """$SKYLB_LOG_LEVEL sets the level when no level is passed; a level passed (--log-level) wins over it."""
    monkeypatch.setenv("SKYLB_LOG_LEVEL", "debug")
    configure_logging(file=buffer)
    structlog.get_logger("test").debug("detail")
    configure_logging(level="error", file=buffer)
    structlog.get_logger("test").warning("dropped")
    assert [line["event"] for line in lines(buffer)] == ["detail"]


def test_unknown_level_in_the_environment_is_refused(monkeypatch):
    """A misspelt $SKYLB_LOG_LEVEL raises ValueError naming it (a process exits 2 rather than guess)."""
    monkeypatch.setenv("SKYLB_LOG_LEVEL", "loud")
    with pytest.raises(ValueError, match="'loud'"):
        configure_logging()


def test_line_carries_the_logger_name_and_the_bound_context(buffer):
    """A line names its logger and carries what was bound with structlog.contextvars (a balancer's region)."""
    configure_logging(file=buffer)
    structlog.contextvars.bind_contextvars(region="eu")
    try:
        structlog.get_logger("skylb.balancer.membership").info("membership_applied", revision=4)
    finally:
        structlog.contextvars.clear_contextvars()
    (line,) = lines(buffer)
    assert (line["logger"], line["region"], line["revision"]) == ("skylb.balancer.membership", "eu", 4)


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


def test_balancer_lines_name_their_logger_and_region_at_info(procs, tmp_path):
    """A running balancer writes every line with its logger's name and its region (bound once at start, not
    passed per call) and, at the default level, no debug line; a request's line carries its request id and
    tenant from the context bound for that request."""
    port, dead = free_ports(2)  # nothing listens on ``dead``: the heartbeat fails and membership logs it
    config = tmp_path / "deployment.yaml"
    config.write_text(f"balancer: {{state_dir: {tmp_path / 'state'}}}\nregions: {{eu: {{}}}}\n")
    balancer = procs.skylb("balancer", "--config", str(config), "--region", "eu", "--port", str(port),
                           "--controller", f"http://127.0.0.1:{dead}", name="balancer-logs",
                           wait_url=f"http://127.0.0.1:{port}/healthz", env={"SKYLB_LOG_LEVEL": ""})
    deadline = time.monotonic() + 20
    while "balancer_registration_failed" not in balancer.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    written = [json.loads(text) for text in balancer.log().splitlines() if text.startswith("{")]
    events = {line["event"]: line for line in written}
    assert events["balancer_started"]["logger"] == "skylb.balancer"
    assert events["balancer_registration_failed"]["logger"] == "skylb.membership"
    assert all(line["region"] == "eu" for line in written)
    assert {line["level"] for line in written} <= {"info", "warning", "error"}
    # No replica serves "m": 404 from the resolve_model stage; its one line names the request and its tenant.
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", method="POST",
                                     data=json.dumps({"model": "m", "prompt": "hi"}).encode(),
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as answered:
        urllib.request.urlopen(request, timeout=10)
    assert answered.value.code == 404
    request_id = answered.value.headers["X-SkyLB-Request-Id"]
    deadline = time.monotonic() + 10
    while f'"request_id": "{request_id}"' not in balancer.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    line = next(json.loads(text) for text in balancer.log().splitlines() if request_id in text)
    assert (line["event"], line["region"], line["request_id"], line["tenant"]) == ("request", "eu", request_id,
                                                                                   "default")


def test_every_request_leaves_one_line_cancelled_ones_included(procs, tmp_path):
    """A request whose client goes away while it is queued, and a stream its client closes after the first event,
    each leave exactly one JSON request line (status 499, "client disconnected"), as an answered request does."""
    cluster = Cluster(procs, tmp_path, balancer={"no_target_timeout_s": 60})
    [gone] = cluster.start_emulator(1, "--model", "model-a", "--time-scale", "0.1", name="emu-a")
    [slow] = cluster.start_emulator(1, "--model", "model-b", "--time-scale", "1", name="emu-b")
    balancer = cluster.start_static_balancer([gone, slow], engine="vllm")
    url = cluster.balancers["local"]
    next(p for p in procs.procs if p.name == "emu-a").kill()  # model-a's requests now wait (no usable replica)
    cluster.wait_until(lambda: [r["healthy"] for r in cluster.status("local")["replicas"] if r["url"] == gone]
                       == [False], what="model-a's replica unhealthy")
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2000}
    with requests.post(f"{url}/v1/chat/completions", json={**chat, "model": "model-b", "stream": True},
                       stream=True, timeout=30) as streamed:
        assert streamed.status_code == 200
        streamed_id = streamed.headers["X-SkyLB-Request-Id"]
        assert next(line for line in streamed.iter_lines() if line).startswith(b"data: ")
    with pytest.raises(requests.exceptions.ReadTimeout):  # the client gives up while its request is queued
        requests.post(f"{url}/v1/chat/completions", json={**chat, "model": "model-a"}, timeout=(5, 1.0))
    cluster.assert_counters_return_to_zero()

    def request_lines() -> list[dict]:
        return [line for line in map(json.loads, balancer.log().splitlines()) if line["event"] == "request"]

    cluster.wait_until(lambda: len(request_lines()) >= 2, what="two request lines")
    by_model = {line["model"]: line for line in request_lines()}
    assert len(request_lines()) == 2 and by_model.keys() == {"model-a", "model-b"}
    assert by_model["model-b"]["id"] == streamed_id
    assert all((line["status"], line["error"]) == (499, "client disconnected") for line in by_model.values())
    assert by_model["model-a"]["route"] is None and by_model["model-b"]["route"] == "local"


def test_standard_library_records_are_json_lines_with_their_logger_and_traceback(buffer):
    """A record of the standard library's logging (aiohttp's loggers) is one JSON line: its message with its
    arguments as ``event``, its level and logger, and its traceback as ``exception``; below warning, nothing."""
    # In a shared test process import-linter's lint_imports (tests/test_layout.py) calls logging.config.dictConfig,
    # which disables every logger that existed then (disable_existing_loggers): this test is about the routing alone.
    logging.disable(logging.NOTSET)
    for name in ("aiohttp.server", "asyncio"):
        logging.getLogger(name).disabled = False
    configure_logging(level="info", file=buffer)
    try:
        raise ValueError("bad\nrequest")
    except ValueError:
        logging.getLogger("aiohttp.server").exception("Error handling request from %s", "127.0.0.1")
    logging.getLogger("aiohttp.server").info("hidden")
    configure_logging(level="info", file=buffer)  # configured again: still one line per record, not two
    logging.getLogger("asyncio").warning("a warning")
    first, second = lines(buffer)
    assert (first["event"], first["level"], first["logger"]) == ("Error handling request from 127.0.0.1", "error",
                                                                 "aiohttp.server")
    assert "ValueError: bad\nrequest" in first["exception"]
    assert (second["event"], second["logger"]) == ("a warning", "asyncio")
