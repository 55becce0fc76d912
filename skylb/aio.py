"""One way to run a server's event loop: uvloop when it is installed, asyncio's own loop otherwise.

uvloop (libuv under asyncio's API) cut the balancer's CPU per proxied request by about a third in
bench/results/overhead.md part (a). ``SKYLB_EVENT_LOOP=asyncio`` forces the standard loop (to rule uvloop out when
debugging). libuv keeps time in whole milliseconds (``loop.time()`` and timers), so a uvloop sleep can end up to
1 ms early; a server whose job is exact delays (the latency proxy) asks for ``precise_timers``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from skylb import environment

__all__ = ["run", "loop_name"]

T = TypeVar("T")


def loop_name(*, precise_timers: bool = False) -> str:
    """``"uvloop"`` or ``"asyncio"``: the loop :func:`run` will use."""
    if precise_timers or (environment.env(environment.EVENT_LOOP) or "uvloop").lower() == "asyncio":
        return "asyncio"
    try:
        import uvloop  # noqa: F401
    except ImportError:  # not built for this platform (Windows): the standard loop works, only slower
        return "asyncio"
    return "uvloop"


def run(main: Coroutine[Any, Any, T], *, precise_timers: bool = False) -> T:
    """Run ``main`` to completion on a new event loop (like ``asyncio.run``) and return its result.

    ``precise_timers``: use asyncio's own loop (monotonic clock at full resolution) even when uvloop is installed.
    """
    if loop_name(precise_timers=precise_timers) == "uvloop":
        import uvloop
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(main)
    return asyncio.run(main)
