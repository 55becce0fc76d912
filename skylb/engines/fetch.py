"""One bounded GET for the adapters, with network failures turned into short human reasons.

Adapters report a failed probe as ``ProbeResult(healthy=False, error=reason)``; the reason shows in the
balancer's status and metrics, so it says what failed in a few words ("GET /metrics: connection refused").
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import aiohttp

__all__ = ["Answer", "FetchError", "get", "json_or_none"]


class FetchError(aiohttp.ClientError):
    """The replica did not answer (refused, reset, timed out), or answered unusably; ``reason`` says it briefly."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class Answer:
    """An HTTP answer: its status and its body decoded as UTF-8 (undecodable bytes replaced)."""

    status: int
    text: str


async def get(session: aiohttp.ClientSession, url: str, path: str, *, timeout_s: float) -> Answer:
    """GET ``url + path`` within ``timeout_s`` seconds (the whole exchange); raises FetchError on network errors."""
    try:
        async with session.get(url + path, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            body = await resp.read()
            return Answer(resp.status, body.decode("utf-8", errors="replace"))
    except asyncio.TimeoutError:
        raise FetchError(f"GET {path}: timed out after {timeout_s:g} s") from None
    except aiohttp.ClientConnectorError as exc:
        refused = isinstance(exc.os_error, ConnectionRefusedError)
        raise FetchError(f"GET {path}: {'connection refused' if refused else 'cannot connect'}") from None
    except (aiohttp.ClientError, OSError) as exc:
        raise FetchError(f"GET {path}: {type(exc).__name__}") from None


def json_or_none(text: str) -> Any:
    """``text`` parsed as JSON, or None when it is not JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return None
