"""The emulated replica's HTTP handlers: vLLM's OpenAI endpoints, request checks and response shapes.

Requests are checked and tokenized as vLLM does (the model's tokenizer and chat template), then
handed to the engine driver; its progress comes back as SSE chunks or one JSON body, with vLLM's
error shape, ``X-Request-Id`` echo and ``--api-key`` rule.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from kvroute.common.requests import decode_json_object, parse_request, prompt_batch
from kvroute.common.responses import chat_messages, input_messages, parse_responses
from kvroute.common.tokens import ChatTemplateError, Tokenizer

from kvroute.replica.emulated.driver import EngineDriver, Generation
from kvroute.replica.emulated.filler import Filler
from kvroute.replica.emulated.vllm_metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from kvroute.replica.emulated.vllm_metrics import ReplicaMetrics
from kvroute.replica.emulated.vllm_protocol import (SSE_DONE, ChatShapes, CompletionShapes, ReplicaError, ResponsesShapes, Shapes, dumps,
                            error_middleware, response_usage, sse, usage)

log = logging.getLogger("kvroute.replica")

COMPLETION_DEFAULT_MAX_TOKENS = 16  # vLLM's CompletionRequest default
STORED_RESPONSES = 10_000  # /v1/responses kept for previous_response_id and GET (oldest dropped)
REQUEST_ID = web.RequestKey("request_id", str)  # the id a response echoes in X-Request-Id


@dataclass
class _Parsed:
    body: dict[str, Any]  # the client's JSON
    request: Any  # its validated model (kvroute.common.requests)
    stream: bool
    include_usage: bool
    continuous_usage: bool
    base_id: str  # X-Request-Id, or a fresh uuid: response ids are cmpl-<it> / chatcmpl-<it>
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass(slots=True)
class StoredResponse:
    """What vLLM's response store keeps of one response: the messages a request continuing it
    starts with, and the response object ``GET /v1/responses/{id}`` answers."""

    messages: list[dict[str, Any]]
    response: dict[str, Any]


class ReplicaHandlers:
    """The endpoints of one replica; ``make_app()`` routes them.  ``started_at`` is read at each
    ``/v1/models`` (the replica sets it when it starts serving)."""

    def __init__(self, *, model: str, max_model_len: int, tokenizer: Tokenizer, driver: EngineDriver,
                 metrics: ReplicaMetrics, api_key: str | None, default_max_tokens: int,
                 started_at: Callable[[], float]):
        self.model = model
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self.filler = Filler(tokenizer)
        self.driver = driver
        self.metrics = metrics
        self.api_key = api_key
        self.default_max_tokens = default_max_tokens
        self.started_at = started_at
        # response id -> what vLLM's store keeps of it (in this process's memory; bounded here)
        self.stored_responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def make_app(self) -> web.Application:
        app = web.Application(middlewares=[error_middleware, self._auth_middleware], client_max_size=64 * 2**20)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/responses", self._responses)
        app.router.add_get("/v1/responses/{response_id}", self._retrieve_response)
        app.router.add_post("/v1/responses/{response_id}/cancel", self._cancel_response)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._detokenize)
        app.router.add_post("/reset_prefix_cache", self._reset_prefix_cache)
        app.on_response_prepare.append(_echo_request_id)
        return app

    @web.middleware
    async def _auth_middleware(self, request: web.Request,
                               handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        # vLLM's --api-key guards the /v1 routes only (health, metrics and tokenize stay open).
        key = self.api_key
        if key and request.path.startswith("/v1"):
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
                raise ReplicaError(401, "Unauthorized")
        return await handler(request)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model:
            raise ReplicaError(404, f"The model `{model}` does not exist.", param="model")

    async def _parse(self, request: web.Request, kind: str) -> _Parsed:
        if self.driver.dead is not None:
            raise ReplicaError(503, f"engine dead: {self.driver.dead!r}", type="EngineDeadError")
        raw = await request.read()
        parsed = parse_request(kind, raw)  # type: ignore[arg-type]  # 400 on bad JSON or fields
        req = parsed.request
        self._check_model(req.model)
        if req.n not in (None, 1):
            raise ReplicaError(400, "the emulated replica generates one choice per request (n=1)", param="n")
        opts = req.stream_options
        if opts is not None and not req.stream:
            raise ReplicaError(400, "Stream options can only be defined when `stream=True`.", param="stream_options")
        if req.cache_salt is not None and not req.cache_salt:
            raise ReplicaError(400, "Parameter 'cache_salt' must be a non-empty string if provided.", param="cache_salt")
        base_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        request[REQUEST_ID] = base_id
        return _Parsed(parsed.body, req, bool(req.stream), bool(opts and opts.include_usage),
                       bool(opts and opts.include_usage and opts.continuous_usage_stats), base_id)

    def _check_lengths(self, n_prompt: int, max_tokens: int) -> None:
        if n_prompt == 0:
            raise ReplicaError(400, "The decoder prompt cannot be empty", param="prompt")
        if n_prompt >= self.max_model_len:
            raise ReplicaError(400, f"This model's maximum context length is {self.max_model_len} tokens. "
                                    f"However, your request has {n_prompt} input tokens. Please reduce the "
                                    "length of the input messages.", param="input_tokens")
        if n_prompt + max_tokens > self.max_model_len:
            raise ReplicaError(400, f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This "
                                    f"model's maximum context length is {self.max_model_len} tokens and your "
                                    f"request has {n_prompt} input tokens ({max_tokens} > {self.max_model_len} - "
                                    f"{n_prompt}).", param="max_tokens")

    def _check_token_ids(self, ids: list[int], param: str) -> None:
        vocab = self.tokenizer.vocab_size
        bad = next((i for i in ids if i >= vocab), None)
        if bad is not None:
            raise ReplicaError(400, f"Token id {bad} is out of vocabulary", param=param)

    def _max_tokens(self, value: int | None, n_prompt: int, default: int, default_reason: str) -> tuple[int, str]:
        """Output length and the finish reason it ends with; checks the prompt fits the context."""
        if value is None:
            # A default never makes a request fail: it shrinks to the context left, as vLLM's does.
            value, reason = max(1, min(default, self.max_model_len - n_prompt)), default_reason
        elif value < 1:
            raise ReplicaError(400, f"max_tokens must be at least 1, got {value}.", param="max_tokens")
        else:
            reason = "length"
        self._check_lengths(n_prompt, value)
        return value, reason

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        p = await self._parse(request, "completion")
        batch = prompt_batch(p.request.prompt)
        if len(batch) != 1:
            raise ReplicaError(400, "the emulated replica takes one prompt per request", param="prompt")
        prompt = batch[0]
        if isinstance(prompt, str):
            ids = await self.tokenizer.aencode_prompt(prompt)
        else:
            ids = list(prompt)
            self._check_token_ids(ids, "prompt")
        max_tokens, reason = self._max_tokens(p.request.max_tokens, len(ids), COMPLETION_DEFAULT_MAX_TOKENS, "length")
        gen = self.driver.generate(ids, max_tokens, reason, p.request.cache_salt, p.stream)
        if p.stream:
            return await self._stream(request, p, gen, CompletionShapes(p.base_id, p.created, self.model))
        return await self._collect(gen, CompletionShapes(p.base_id, p.created, self.model))

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        p = await self._parse(request, "chat")
        ids = await self._encode_chat(p.body)
        req = p.request
        value = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens, reason = self._max_tokens(value, len(ids), self.default_max_tokens, "stop")
        gen = self.driver.generate(ids, max_tokens, reason, req.cache_salt, p.stream)
        if p.stream:
            return await self._stream(request, p, gen, ChatShapes(p.base_id, p.created, self.model))
        return await self._collect(gen, ChatShapes(p.base_id, p.created, self.model))

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        """vLLM's /v1/responses without Harmony: instructions, the stored conversation of
        previous_response_id and the input's messages, rendered as a chat (common/responses.py
        states the rules); the answer stored for the next turn unless ``store`` is false."""
        if self.driver.dead is not None:
            raise ReplicaError(503, f"engine dead: {self.driver.dead!r}", type="EngineDeadError")
        parsed = parse_responses(await request.read())
        body, req = parsed.body, parsed.request
        self._check_model(req.model)
        if isinstance(body["input"], list) and len(input_messages(body)) != len(body["input"]):
            raise ReplicaError(400, "the emulated replica takes message items only", param="input")
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            stored = self.stored_responses.get(req.previous_response_id)
            if stored is None:
                raise ReplicaError(404, f"Response with id '{req.previous_response_id}' not found.",
                                   type="invalid_request_error")
            history = stored.messages
        messages = chat_messages(req.instructions, history, input_messages(body))
        ids = await self._encode_chat({"messages": messages})
        max_tokens, reason = self._max_tokens(req.max_output_tokens, len(ids), self.default_max_tokens, "stop")
        base_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        request[REQUEST_ID] = base_id
        gen = self.driver.generate(ids, max_tokens, reason, req.cache_salt, bool(req.stream))
        shapes = ResponsesShapes(base_id, int(time.time()), self.model, body)
        resp: web.StreamResponse | None = None
        if req.stream:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await resp.prepare(request)
            await resp.write(shapes.opening())
        state: Generation | None = None
        async with contextlib.aclosing(gen):
            async for state, new in gen:
                if new and resp is not None:
                    await resp.write(shapes.delta(self.filler.text(len(state.prompt_ids), state.generated - new, new)))
        assert state is not None
        text = self.filler.text(len(state.prompt_ids), 0, state.generated)
        stats = response_usage(len(state.prompt_ids), state.generated, state.cached_tokens)
        answer = shapes.response("completed", text, stats)
        if req.store is not False:
            self.stored_responses[shapes.id] = StoredResponse([*messages, {"role": "assistant", "content": text}], answer)
            while len(self.stored_responses) > STORED_RESPONSES:
                self.stored_responses.popitem(last=False)
        if resp is None:
            return web.Response(text=dumps(answer), content_type="application/json")
        await resp.write(shapes.closing(text, stats))
        await resp.write_eof()
        return resp

    def _stored(self, request: web.Request) -> StoredResponse:
        response_id = request.match_info["response_id"]
        stored = self.stored_responses.get(response_id)
        if stored is None:
            raise ReplicaError(404, f"Response with id '{response_id}' not found.", type="invalid_request_error")
        return stored

    async def _retrieve_response(self, request: web.Request) -> web.Response:
        """vLLM's ``GET /v1/responses/{id}``: the stored response object, or 404 with vLLM's message."""
        return web.Response(text=dumps(self._stored(request).response), content_type="application/json")

    async def _cancel_response(self, request: web.Request) -> web.Response:
        """vLLM's ``POST /v1/responses/{id}/cancel``: only a background response still queued or in
        progress can be cancelled; this replica stores responses once complete (it has no
        ``background`` mode), so a stored one gets vLLM's 400, an unknown one its 404."""
        self._stored(request)
        raise ReplicaError(400, "Cannot cancel a synchronous response.", type="invalid_request_error")

    async def _encode_chat(self, body: dict[str, Any]) -> list[int]:
        """The chat's prompt ids, rendered as vLLM renders it: tools, documents and template
        kwargs go into the template (so the router, rendering the same way, hashes the same ids)."""
        options: dict[str, Any] = {}
        for key, default in (("add_generation_prompt", True), ("continue_final_message", False)):
            flag = body.get(key, default)
            if not isinstance(flag, bool):
                raise ReplicaError(400, f"{key} must be a boolean", param=key)
            options[key] = flag
        for key in ("tools", "documents"):
            if body.get(key) is not None:
                options[key] = body[key]
        kwargs = body.get("chat_template_kwargs")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise ReplicaError(400, "chat_template_kwargs must be an object", param="chat_template_kwargs")
        try:
            # as template_kwargs: variables that may override the options, never the template
            return await self.tokenizer.aencode_chat(body["messages"], template_kwargs=kwargs, **options)
        except ChatTemplateError as exc:
            raise ReplicaError(400, str(exc), param="messages") from None
        except TypeError as exc:  # a template kwarg colliding with an option: the client's doing
            raise ReplicaError(400, f"chat_template_kwargs: {exc}", param="chat_template_kwargs") from None

    async def _collect(self, gen: AsyncIterator[tuple[Generation, int]], shapes: Shapes) -> web.Response:
        state: Generation | None = None
        async with contextlib.aclosing(gen):
            async for state, _ in gen:
                pass
        assert state is not None
        text = self.filler.text(len(state.prompt_ids), 0, state.generated)
        reason = "abort" if state.aborted else state.finish_reason
        body = shapes.full(text, reason, _usage(state))
        return web.Response(text=dumps(body), content_type="application/json")

    async def _stream(self, request: web.Request, p: _Parsed, gen: AsyncIterator[tuple[Generation, int]],
                      shapes: Shapes) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        first = True
        try:
            async with contextlib.aclosing(gen):
                async for state, new in gen:
                    done = state.finished or state.aborted
                    if not new and not done:
                        continue
                    text = self.filler.text(len(state.prompt_ids), state.generated - new, new)
                    reason = ("abort" if state.aborted else state.finish_reason) if done else None
                    stats = _usage(state) if p.continuous_usage else None
                    out = b""
                    if first:
                        opening = shapes.opening(stats)  # vLLM sends the chat role with the first output
                        if opening is not None:
                            out += sse(opening)
                        first = False
                    out += sse(shapes.chunk(text, reason, stats))
                    await resp.write(out)
            tail = sse(shapes.usage_chunk(_usage(state, exclude_none=True))) if p.include_usage else b""
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as exc:  # noqa: BLE001 - after the first byte an error travels in-stream
            log.exception("stream failed")
            tail = sse(ReplicaError(500, f"stream failed: {exc!r}").body())
        await resp.write(tail + SSE_DONE)
        await resp.write_eof()
        return resp

    # ------------------------------------------------------------------ other endpoints

    async def _models(self, request: web.Request) -> web.Response:
        created = int(self.started_at())
        card = {
            "id": self.model, "object": "model", "created": created, "owned_by": "vllm", "root": self.model,
            "parent": None, "max_model_len": self.max_model_len,
            "permission": [{
                "id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission", "created": created,
                "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                "organization": "*", "group": None, "is_blocking": False,
            }],
        }
        return web.json_response({"object": "list", "data": [card]}, dumps=dumps)

    async def _health(self, request: web.Request) -> web.Response:
        if self.driver.dead is not None:
            raise ReplicaError(503, f"engine dead: {self.driver.dead!r}", type="EngineDeadError")
        return web.Response(status=200)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": METRICS_CONTENT_TYPE})

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = decode_json_object(await request.read())
        self._check_model(_optional_str(body, "model"))
        if ("prompt" in body) == ("messages" in body):
            raise ReplicaError(400, "give exactly one of 'prompt' or 'messages'")
        if "prompt" in body:
            prompt = body["prompt"]
            if not isinstance(prompt, str):
                raise ReplicaError(400, "prompt must be a string", param="prompt")
            add_special = body.get("add_special_tokens", True)
            if not isinstance(add_special, bool):
                raise ReplicaError(400, "add_special_tokens must be a boolean", param="add_special_tokens")
            ids = await self.tokenizer.aencode_prompt(prompt, add_special_tokens=add_special)
        else:
            if not isinstance(body["messages"], list):
                raise ReplicaError(400, "messages must be a list", param="messages")
            ids = await self._encode_chat(body)
        return web.json_response({"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
                                  "token_strs": None}, dumps=dumps)

    async def _detokenize(self, request: web.Request) -> web.Response:
        body = decode_json_object(await request.read())
        self._check_model(_optional_str(body, "model"))
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                   for t in tokens):
            raise ReplicaError(400, "tokens must be a list of non-negative token ids", param="tokens")
        self._check_token_ids(tokens, "tokens")
        return web.json_response({"prompt": self.tokenizer.decode(tokens)}, dumps=dumps)

    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        # vLLM resets only when no request holds blocks; it then answers 200 either way and logs.
        # Here a refusal is a 409, so callers know the cache was not cleared.
        if not self.driver.reset_prefix_cache():
            raise ReplicaError(409, "requests are running: the prefix cache was not reset")
        return web.Response(status=200)


def _optional_str(body: dict[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise ReplicaError(400, f"{key} must be a string", param=key)
    return value


def _usage(state: Generation, *, exclude_none: bool = False) -> dict[str, Any]:
    return usage(len(state.prompt_ids), state.generated, state.cached_tokens, exclude_none=exclude_none)


async def _echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    request_id = request.get(REQUEST_ID) or request.headers.get("X-Request-Id")
    if request_id:
        response.headers["X-Request-Id"] = request_id
