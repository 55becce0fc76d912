"""A generic OpenAI-compatible server (a hosted endpoint, LiteLLM, LM Studio, LocalAI): the OpenAI routes and
nothing else, no /metrics, no /health, so a balancer can read no load signal from it (skylb/engines/openai.py counts
its own in-flight requests instead) and checks liveness with ``GET /v1/models``.

Sources: the OpenAI API reference ("Models": the model object ``{"id", "object": "model", "created", "owned_by"}``;
"Error codes": ``{"error": {"message", "type", "param", "code"}}`` with ``code`` a string such as
``"model_not_found"`` or null, a 404 "The model `x` does not exist or you do not have access to it."); a failure
after a stream started is a ``data: {"error": {...}}`` event; shared/reference/engines.md ("OpenAI-compatible API,
as a balancer sees it").
"""

from __future__ import annotations

from typing import Any, ClassVar

from aiohttp import web

from bench.emulator.personalities.base import ApiError
from bench.emulator.personalities.openai import OpenAIServing

__all__ = ["GenericOpenAIPersonality"]

#: HTTP status -> OpenAI's error ``type`` and ``code`` for the errors the emulator raises.
_TYPES = {400: ("invalid_request_error", None), 404: ("invalid_request_error", "model_not_found"),
          429: ("requests", "rate_limit_exceeded"), 500: ("server_error", None), 503: ("server_error", None)}


class GenericOpenAIPersonality(OpenAIServing, name="openai"):
    """The OpenAI API alone in front of the replica."""

    owned_by: ClassVar[str] = "system"

    def routes(self, app: web.Application) -> None:
        """Only the OpenAI routes: no /health, /metrics or engine-specific endpoint."""
        self.openai_routes(app)

    def error_response(self, err: ApiError) -> web.Response:
        """OpenAI's error object: ``code`` a string or null, never the HTTP status."""
        err_type, code = _TYPES.get(err.status, ("invalid_request_error" if err.status < 500 else "server_error",
                                                 None))
        body = {"error": {"message": err.message, "type": err_type, "param": err.param, "code": code}}
        return web.json_response(body, status=err.status)

    def resolve_model(self, requested: str | None) -> str:
        """The served model a request names; 404 with OpenAI's message for another name."""
        if requested is not None and requested not in self.options.models:
            raise ApiError(404, f"The model `{requested}` does not exist or you do not have access to it.",
                           param="model")
        return super().resolve_model(requested)

    def model_card(self, name: str) -> dict[str, Any]:
        """OpenAI's model object: no ``max_model_len``, ``root`` or ``permission`` (vLLM's additions)."""
        return {"id": name, "object": "model", "created": self.created, "owned_by": self.owned_by}
