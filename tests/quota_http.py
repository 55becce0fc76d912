"""A JSON POST for the quota tests that returns error answers too (429s and 503s are what they check)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

__all__ = ["http_post"]


def http_post(url: str, body: dict, *, key: str | None = None, timeout: float = 30.0) -> tuple[int, dict, dict]:
    """POST ``body`` as JSON (with ``Authorization: Bearer key`` when given); (status, decoded body, headers), also
    for error statuses."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read()), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}"), dict(exc.headers)
