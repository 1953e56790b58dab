"""What vLLM's OpenAI server puts on the wire: error bodies, SSE framing, usage, response objects.

Shapes follow vLLM's serialization: chat chunks are dumped with ``exclude_unset`` (so a content
chunk carries no ``usage`` key and only the last one a ``stop_reason``), completion chunks in full
(``"usage": null`` on each), the final usage chunk with ``exclude_none``.  ``prompt_tokens_details``
is filled only when some prompt tokens were cached, as vLLM does; otherwise it is null in a body
and absent from the usage chunk.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web

from kvroute.common.errors import ApiError

log = logging.getLogger("kvroute.replica")

_json = msgspec.json.Encoder()

# vLLM names the error type after the exception class; the SDK keys its own on the status code.
_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                405: "MethodNotAllowedError", 409: "ConflictError", 413: "BadRequestError",
                500: "InternalServerError", 501: "NotImplementedError", 503: "ServiceUnavailableError"}


class ReplicaError(Exception):
    """An error answered in vLLM's shape: ``{"error": {"message", "type", "param", "code": status}}``."""

    def __init__(self, status: int, message: str, *, type: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _ERROR_TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")
        self.param = param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}

    def response(self) -> web.Response:
        return web.Response(status=self.status, body=_json.encode(self.body()), content_type="application/json")


@web.middleware
async def error_middleware(request: web.Request,
                           handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """Every failure leaves as a JSON error in vLLM's shape, the framework's 404/405/413 included."""
    try:
        return await handler(request)
    except ReplicaError as exc:
        return exc.response()
    except ApiError as exc:  # the shared request validation (kvroute.common.requests) raises the router's kind
        return ReplicaError(exc.status, exc.message, param=exc.param).response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = {404: f"no route for {request.method} {request.path}",
                   405: f"method {request.method} not allowed on {request.path}"}.get(exc.status, exc.reason)
        return ReplicaError(exc.status, message).response()
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:  # noqa: BLE001 - never a traceback to the client
        log.exception("unhandled error on %s %s", request.method, request.path)
        return ReplicaError(500, "internal server error").response()


def dumps(obj: Any) -> str:
    return _json.encode(obj).decode()


def sse(obj: Any) -> bytes:
    return b"data: " + _json.encode(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int, *,
          exclude_none: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
                           "completion_tokens": completion_tokens}
    if cached_tokens:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    elif not exclude_none:
        out["prompt_tokens_details"] = None
    return out


class Shapes:
    """The JSON objects of one endpoint for one request: the opening chunk (None if the endpoint
    has none), content chunks, the non-streaming body and the final usage chunk."""

    def __init__(self, base_id: str, created: int, model: str):
        self.base_id = base_id
        self.created = created
        self.model = model

    def opening(self, usage: dict | None) -> dict | None:
        raise NotImplementedError

    def chunk(self, text: str, finish_reason: str | None, usage: dict | None) -> dict:
        raise NotImplementedError

    def full(self, text: str, finish_reason: str, usage: dict) -> dict:
        raise NotImplementedError

    def usage_chunk(self, usage: dict) -> dict:
        raise NotImplementedError


class CompletionShapes(Shapes):
    def _head(self) -> dict[str, Any]:
        return {"id": f"cmpl-{self.base_id}", "object": "text_completion", "created": self.created, "model": self.model}

    def opening(self, usage: dict | None) -> None:
        return None

    def chunk(self, text: str, finish_reason: str | None, usage: dict | None) -> dict:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason, "stop_reason": None}
        return {**self._head(), "choices": [choice], "usage": usage}

    def full(self, text: str, finish_reason: str, usage: dict) -> dict:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason, "stop_reason": None,
                  "prompt_logprobs": None}
        return {**self._head(), "choices": [choice], "usage": usage, "system_fingerprint": None,
                "kv_transfer_params": None}

    def usage_chunk(self, usage: dict) -> dict:
        return {**self._head(), "choices": [], "usage": usage}


class ChatShapes(Shapes):
    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": f"chatcmpl-{self.base_id}", "object": obj, "created": self.created, "model": self.model}

    def _chunk(self, choice: dict, usage: dict | None) -> dict:
        out = {**self._head("chat.completion.chunk"), "choices": [choice]}
        if usage is not None:  # continuous usage stats
            out["usage"] = usage
        return out

    def opening(self, usage: dict | None) -> dict:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return self._chunk(choice, usage)

    def chunk(self, text: str, finish_reason: str | None, usage: dict | None) -> dict:
        choice: dict[str, Any] = {"index": 0, "delta": {"content": text}, "logprobs": None,
                                  "finish_reason": finish_reason}
        if finish_reason is not None:
            choice["stop_reason"] = None
        return self._chunk(choice, usage)

    def full(self, text: str, finish_reason: str, usage: dict) -> dict:
        message = {"role": "assistant", "content": text, "refusal": None, "annotations": None, "audio": None,
                   "function_call": None, "tool_calls": [], "reasoning_content": None}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason,
                  "stop_reason": None}
        return {**self._head("chat.completion"), "choices": [choice], "service_tier": None,
                "system_fingerprint": None, "usage": usage, "prompt_logprobs": None, "kv_transfer_params": None}

    def usage_chunk(self, usage: dict) -> dict:
        return {**self._head("chat.completion.chunk"), "choices": [], "usage": usage}


def response_usage(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """The Responses API's usage, which vLLM fills with the cached count always (0 included)."""
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + output_tokens}


class ResponsesShapes:
    """The objects of one ``/v1/responses`` answer: the response (whole or as it stands) and the
    stream's events, each numbered, framed as ``event: TYPE`` + ``data: JSON``."""

    def __init__(self, base_id: str, created: int, model: str, body: dict[str, Any]):
        self.id = f"resp_{base_id}"
        self.item_id = f"msg_{base_id}"
        self.created = created
        self.model = model
        self.body = body
        self.sequence = 0

    def _message(self, text: str, status: str) -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": None}] if text or status == "completed" else []
        return {"id": self.item_id, "type": "message", "role": "assistant", "status": status, "content": content}

    def response(self, status: str, text: str | None, usage: dict | None) -> dict[str, Any]:
        body = self.body
        return {
            "id": self.id, "object": "response", "created_at": self.created, "model": self.model, "status": status,
            "instructions": body.get("instructions"), "previous_response_id": body.get("previous_response_id"),
            "output": [] if text is None else [self._message(text, "completed")], "usage": usage,
            "error": None, "incomplete_details": None, "metadata": body.get("metadata"),
            "parallel_tool_calls": True, "temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
            "tool_choice": "auto", "tools": [], "max_output_tokens": body.get("max_output_tokens"),
            "store": body.get("store", True), "text": {"format": {"type": "text"}}, "truncation": "disabled",
            "user": body.get("user"),
        }

    def event(self, type: str, **fields: Any) -> bytes:
        payload = {"type": type, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {type}\n".encode() + sse(payload)

    def opening(self) -> bytes:
        item = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        return (self.event("response.created", response=self.response("in_progress", None, None))
                + self.event("response.in_progress", response=self.response("in_progress", None, None))
                + self.event("response.output_item.added", output_index=0, item=self._message("", "in_progress"))
                + self.event("response.content_part.added", **item,
                             part={"type": "output_text", "text": "", "annotations": []}))

    def delta(self, text: str) -> bytes:
        return self.event("response.output_text.delta", item_id=self.item_id, output_index=0, content_index=0,
                          delta=text, logprobs=[])

    def closing(self, text: str, usage: dict) -> bytes:
        item = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        return (self.event("response.output_text.done", **item, text=text, logprobs=[])
                + self.event("response.content_part.done", **item,
                             part={"type": "output_text", "text": text, "annotations": []})
                + self.event("response.output_item.done", output_index=0, item=self._message(text, "completed"))
                + self.event("response.completed", response=self.response("completed", text, usage)))
