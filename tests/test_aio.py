"""skylb.aio: the servers' event loop is uvloop when installed, and SKYLB_EVENT_LOOP=asyncio opts out."""

import asyncio

import pytest

from skylb import aio


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_run_uses_uvloop_when_installed(monkeypatch):
    pytest.importorskip("uvloop")
    monkeypatch.delenv("SKYLB_EVENT_LOOP", raising=False)
    assert aio.loop_name() == "uvloop"
    assert aio.run(_loop_module()).startswith("uvloop")


def test_environment_selects_the_standard_loop(monkeypatch):
    monkeypatch.setenv("SKYLB_EVENT_LOOP", "asyncio")
    assert aio.loop_name() == "asyncio"
    assert aio.run(_loop_module()).startswith("asyncio")


def test_precise_timers_keep_the_standard_loop(monkeypatch):
    """uvloop keeps time in whole milliseconds; precise_timers (the latency proxy) always gets asyncio's loop."""
    monkeypatch.delenv("SKYLB_EVENT_LOOP", raising=False)
    assert aio.loop_name(precise_timers=True) == "asyncio"
    assert aio.run(_loop_module(), precise_timers=True).startswith("asyncio")
