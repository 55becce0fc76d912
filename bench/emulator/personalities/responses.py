"""vLLM's OpenAI Responses API on an emulated replica: ``POST /v1/responses`` (streamed and not) and
``GET /v1/responses/{id}``, with stored responses and ``previous_response_id`` in this replica's memory.

Source: vLLM's ``vllm/entrypoints/openai/serving_responses.py`` and ``api_server.py``:

* A request's prompt is its ``instructions`` (a system message), then, with ``previous_response_id``, the stored
  conversation of that response (its messages and its output), then its ``input`` (a string: one user message; or
  message items whose content is a string or text parts). ``max_output_tokens`` caps the output.
* ``store`` (default true) keeps the response and its conversation in memory (``response_store``, ``msg_store``),
  as vLLM does with ``VLLM_ENABLE_RESPONSES_API_STORE=1``; vLLM never evicts them, the emulator keeps the latest
  ``MAX_STORED`` so a long benchmark does not grow without bound. An unknown ``previous_response_id`` or retrieved
  id: 404 ``Response with id '...' not found.`` (``invalid_request_error``); an id not starting with ``resp``: 400.
* Streamed (SSE, ``event: <type>`` then ``data: <json>`` per event, no ``[DONE]``): ``response.created``,
  ``response.in_progress``, ``response.output_item.added``, ``response.content_part.added``, one
  ``response.output_text.delta`` per token, ``response.output_text.done``, ``response.content_part.done``,
  ``response.output_item.done``, ``response.completed``; every event with its ``sequence_number``.

Not emulated: tools, reasoning items, background mode, ``include``, logprobs.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from typing import Any

from aiohttp import web

from bench.emulator.model import FinishedRequest, chat_tokens
from bench.emulator.personalities.base import ApiError, Generation

__all__ = ["ResponsesServing", "MAX_STORED"]

#: Stored responses kept per replica (the oldest dropped first).
MAX_STORED = 10_000
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


def _input_messages(body: dict) -> list[tuple[str, str]]:
    """``input`` as (role, text) pairs; ApiError 400 for a shape vLLM's pydantic model refuses."""
    value = body.get("input")
    if isinstance(value, str):
        return [("user", value)]
    if not isinstance(value, list) or not value:
        raise ApiError(400, "Field required: `input` (a string or a list of items).", param="input")
    pairs = []
    for i, item in enumerate(value):
        if not isinstance(item, dict) or not isinstance(item.get("role"), str):
            raise ApiError(400, f"input[{i}] must be a message with a string `role` (only messages are supported "
                                "by the SkyLB emulator).", param="input")
        content = item.get("content")
        if isinstance(content, list):
            content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
        if not isinstance(content, str):
            raise ApiError(400, f"input[{i}].content must be a string or a list of text parts.", param="input")
        pairs.append((item["role"], content))
    return pairs


class ResponsesServing:
    """The Responses API routes, mixed into an OpenAI-compatible personality (needs ``start``, ``resolve_model``,
    ``error_response``, ``should_fail``, ``failure``)."""

    def responses_routes(self, app: web.Application) -> None:
        """Register ``POST /v1/responses`` and ``GET /v1/responses/{response_id}``."""
        self._stored: OrderedDict[str, tuple[dict, list[tuple[str, str]]]] = OrderedDict()
        self.add(app, "POST", "/v1/responses", self.create_response)
        self.add(app, "GET", "/v1/responses/{response_id}", self.retrieve_response)

    def _stored_conversation(self, response_id: Any) -> list[tuple[str, str]]:
        if not isinstance(response_id, str) or not response_id.startswith("resp"):
            raise ApiError(400, f"Invalid 'response_id': '{response_id}'. Expected an ID that begins with 'resp'.",
                           err_type="invalid_request_error", param="response_id")
        if response_id not in self._stored:
            raise ApiError(404, f"Response with id '{response_id}' not found.", err_type="invalid_request_error",
                           param="response_id")
        return self._stored[response_id][1]

    async def retrieve_response(self, request: web.Request) -> web.Response:
        """``GET /v1/responses/{id}``: the stored response object, or 404."""
        try:
            self._stored_conversation(request.match_info["response_id"])
        except ApiError as err:
            return self.error_response(err)
        return web.json_response(self._stored[request.match_info["response_id"]][0])

    async def create_response(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/responses``: generate, store (``store``), answer whole or as events (``stream``)."""
        try:
            body = json.loads(await request.read())
            if not isinstance(body, dict):
                raise ApiError(400, "The request body must be a JSON object.")
            model = self.resolve_model(body.get("model"))
            previous = body.get("previous_response_id")
            history = [] if previous is None else list(self._stored_conversation(previous))
            conversation = history + _input_messages(body)
            instructions = body.get("instructions")
            system = [("system", instructions)] if isinstance(instructions, str) and instructions else []
            max_tokens = body.get("max_output_tokens")
            if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 1):
                raise ApiError(400, "`max_output_tokens` must be a positive integer.", param="max_output_tokens")
            gen = self.start(chat_tokens(system + conversation), max_tokens,
                             ignore_eos=body.get("ignore_eos") is True, prefix="resp")
        except ValueError as exc:  # a body that is not JSON
            return self.error_response(ApiError(400, f"Invalid JSON body: {exc}"))
        except ApiError as err:
            return self.error_response(err)
        shell = self._response_shell(gen, body, model)
        try:
            if body.get("stream") is True:
                return await self._stream_response(request, gen, shell, conversation, body)
            return await self._whole_response(gen, shell, conversation, body)
        finally:
            gen.close()

    def _response_shell(self, gen: Generation, body: dict, model: str) -> dict:
        """The response object before any output (status ``in_progress``), as vLLM's ResponsesResponse."""
        return {"id": "resp_" + gen.request_id.rsplit("-", 1)[-1], "object": "response", "created_at": int(time.time()),
                "model": model, "status": "in_progress", "output": [], "usage": None,
                "instructions": body.get("instructions"), "previous_response_id": body.get("previous_response_id"),
                "max_output_tokens": body.get("max_output_tokens"), "store": body.get("store", True) is not False,
                "temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
                "tool_choice": "auto", "tools": [], "parallel_tool_calls": True, "text": {"format": {"type": "text"}},
                "truncation": "disabled", "metadata": body.get("metadata"), "incomplete_details": None,
                "error": None, "background": False, "reasoning": None, "service_tier": "auto", "user": None}

    def _finish(self, shell: dict, text: str, fin: FinishedRequest, conversation: list, body: dict, *,
                item_id: str | None = None) -> dict:
        """Complete ``shell`` with its output message (``item_id``) and usage; store it with its conversation when
        asked."""
        message = {"id": item_id or f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "status": "completed",
                   "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}
        incomplete = fin.finish_reason == "length"
        shell.update(status="incomplete" if incomplete else "completed", output=[message],
                     incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
                     usage={"input_tokens": fin.prompt_tokens,
                            "input_tokens_details": {"cached_tokens": fin.cached_tokens},
                            "output_tokens": fin.completion_tokens,
                            "output_tokens_details": {"reasoning_tokens": 0},
                            "total_tokens": fin.prompt_tokens + fin.completion_tokens})
        if body.get("store", True) is not False:
            self._stored[shell["id"]] = (shell, [*conversation, ("assistant", text)])
            while len(self._stored) > MAX_STORED:
                self._stored.popitem(last=False)
        return shell

    async def _whole_response(self, gen: Generation, shell: dict, conversation: list, body: dict) -> web.Response:
        words = []
        async for out in gen.tokens():
            if self.should_fail(out.index):
                return self.error_response(self.failure())
            words.append(out.text)
        return web.json_response(self._finish(shell, " ".join(words), out.finished, conversation, body))

    async def _stream_response(self, request: web.Request, gen: Generation, shell: dict, conversation: list,
                               body: dict) -> web.StreamResponse:
        resp = web.StreamResponse(headers=_SSE_HEADERS)
        await resp.prepare(request)
        sequence = iter(range(1 << 30))
        item_id = f"msg_{uuid.uuid4().hex}"
        where = {"item_id": item_id, "output_index": 0, "content_index": 0}

        async def send(kind: str, **fields: Any) -> None:
            event = {"type": kind, "sequence_number": next(sequence), **fields}
            await resp.write(f"event: {kind}\ndata: {json.dumps(event)}\n\n".encode())

        try:
            await send("response.created", response=shell)
            await send("response.in_progress", response=shell)
            item = {"id": item_id, "type": "message", "role": "assistant", "status": "in_progress", "content": []}
            await send("response.output_item.added", output_index=0, item=item)
            await send("response.content_part.added", **where, part={"type": "output_text", "text": "",
                                                                      "annotations": []})
            words = []
            async for out in gen.tokens():
                if self.should_fail(out.index):
                    err = self.failure()
                    await send("error", code=str(err.status), message=err.message, param=None)
                    await resp.write_eof()
                    return resp
                words.append(out.text)
                await send("response.output_text.delta", **where, delta=out.text if out.index == 0 else " " + out.text,
                           logprobs=[])
            final = self._finish(shell, " ".join(words), out.finished, conversation, body, item_id=item_id)
            message = final["output"][0]
            await send("response.output_text.done", **where, text=message["content"][0]["text"], logprobs=[])
            await send("response.content_part.done", **where, part=message["content"][0])
            await send("response.output_item.done", output_index=0, item=message)
            await send("response.completed", response=final)
            await resp.write_eof()
        except ConnectionResetError:
            pass  # the client went away: create_response's finally cancels the generation
        return resp
