"""The emulated replica: an HTTP server that speaks vLLM's OpenAI protocol, driven in real time by
the emulated engine, publishing KV cache events in vLLM's wire format.

What a client sees is what a vLLM server with ``--enable-prefix-caching --enable-prompt-tokens-details
--kv-events-config ...`` shows: the same endpoints, response shapes, SSE framing, error shape,
metric names and KV events.  What it computes is the emulation: prompts are tokenized for real
(the model's tokenizer and chat template), their blocks go through the engine's prefix cache, and
tokens come out as deterministic filler text at the times the engine's steps complete.

Time: the engine runs on a virtual clock, ``virtual = wall elapsed / time_scale``.  A driver task
sleeps until the in-progress step's completion time, runs the engine to it, publishes that step's
KV events as one batch (vLLM publishes once per step) and hands each request its new tokens; a new
request wakes it.  ``time_scale`` 0.1 runs ten times faster than the profile; 0 runs steps back to
back (answers at once, for measuring what sits in front of the replica).  Latency metrics are in
virtual seconds: what the emulated GPU would report.

Many replicas fit in one process: each has its own aiohttp runner, Prometheus registry, engine and
ZMQ sockets (``EmulatedReplica(config)``, ``await start()``, ``url``, ``await stop()``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from router.blocks import block_hashes, namespace_seed
from router.requests import decode_json_object, parse_request, prompt_batch
from router.tokens import ChatTemplateError, Tokenizer

from . import kv_events
from .engine import EmulatedEngine, EngineRequest, EngineUpdate
from .profile import DEFAULT_PROFILE, PROFILES, TimingProfile
from .publisher import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEventPublisher, WireEvent
from .vllm_metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .vllm_metrics import ReplicaMetrics, cache_config_labels
from .vllm_protocol import (SSE_DONE, ChatShapes, CompletionShapes, ReplicaError, Shapes, dumps, error_middleware,
                            sse, usage)

log = logging.getLogger("kvroute.replica")

SHUTDOWN_GRACE_S = 1.0  # in-flight requests finish within this on stop(), else are cut
COMPLETION_DEFAULT_MAX_TOKENS = 16  # vLLM's CompletionRequest default
DEFAULT_MAX_MODEL_LEN = 32768
# Filler the replica "generates": readable, ASCII (one piece per token decodes cleanly).
FILLER_TEXT = (
    " The quick brown fox jumps over the lazy dog while the router keeps every prefix warm in the"
    " cache, and each replica answers with the same patient filler text until its tokens run out."
)
REQUEST_ID = web.RequestKey("request_id", str)  # the id a response echoes in X-Request-Id


def default_tokenizer_dir() -> Path:
    """The project's tiny test tokenizer: the committed copy, else built once into a user cache."""
    committed = Path(__file__).resolve().parents[2] / "tests" / "assets" / "tiny-tokenizer"
    if (committed / "tokenizer.json").is_file():
        return committed
    cached = Path.home() / ".cache" / "kvroute" / "tiny-tokenizer"
    if not (cached / "tokenizer.json").is_file():
        from replica.tiny_model import build_tokenizer

        build_tokenizer(cached)
    return cached


@dataclass
class ReplicaConfig:
    model: str
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port, read back from ``EmulatedReplica.url``
    tokenizer_dir: str | None = None  # None: the project's tiny tokenizer
    profile: str = DEFAULT_PROFILE.name
    block_size: int | None = None  # None: the profile's
    num_gpu_blocks: int | None = None  # None: the profile's
    max_model_len: int | None = None  # None: min(32768, KV capacity in tokens)
    events_endpoint: str | None = None  # e.g. tcp://*:5557 (bind) or tcp://router:5557 (connect)
    replay_endpoint: str | None = None
    events_topic: str = "kv"
    api_key: str | None = None
    time_scale: float = 1.0
    default_max_tokens: int = 16  # chat requests without max_tokens "stop" after this many tokens

    def timing_profile(self) -> TimingProfile:
        if self.profile not in PROFILES:
            raise ValueError(f"unknown profile {self.profile!r}; known: {', '.join(sorted(PROFILES))}")
        profile = PROFILES[self.profile]
        overrides = {k: v for k, v in (("block_size", self.block_size), ("num_gpu_blocks", self.num_gpu_blocks))
                     if v is not None}
        return profile.replace(**overrides) if overrides else profile


# ---------------------------------------------------------------------------------------------
# Clock and filler


class VirtualClock:
    """Engine time.  ``scale`` > 0: wall time since start divided by ``scale``.  ``scale`` == 0: no
    wall time at all; the driver advances it to each step's completion as it runs the step."""

    def __init__(self, scale: float):
        if scale < 0:
            raise ValueError("time_scale must be >= 0")
        self.scale = scale
        self._t0 = time.monotonic()
        self._instant = 0.0

    def now(self) -> float:
        if self.scale == 0:
            return self._instant
        return (time.monotonic() - self._t0) / self.scale

    def wall_delay(self, virtual: float) -> float:
        """Wall seconds until ``virtual``, 0 if due."""
        if self.scale == 0:
            return 0.0
        return max(0.0, self._t0 + virtual * self.scale - time.monotonic())

    def advance_to(self, virtual: float) -> None:
        if self.scale == 0 and virtual > self._instant:
            self._instant = virtual


class Filler:
    """Deterministic output: FILLER_TEXT's tokens cycled, starting where the prompt length points."""

    def __init__(self, tokenizer: Tokenizer):
        ids = [i for i in tokenizer.encode_prompt(FILLER_TEXT, add_special_tokens=False)
               if tokenizer.decode([i], skip_special_tokens=True)]
        if not ids:
            raise ValueError("the tokenizer decodes no filler token")
        self.ids = ids
        self._pieces = [tokenizer.decode([i]) for i in ids]

    def text(self, prompt_len: int, start: int, count: int) -> str:
        n = len(self.ids)
        return "".join(self._pieces[(prompt_len + k) % n] for k in range(start, start + count))


# ---------------------------------------------------------------------------------------------
# The replica


@dataclass
class _Live:
    """A request the engine holds: where its updates go, and what its metrics need."""

    queue: asyncio.Queue[EngineUpdate]
    arrival: float  # virtual time of submission
    finish_reason: str  # "length" when the client set max_tokens, "stop" when the default ran out
    streaming: bool  # wants every token as it comes; a non-streaming handler only wakes to finish
    first_token_at: float | None = None
    unseen_tokens: int = 0  # tokens tallied without waking a non-streaming handler


@dataclass
class _Generation:
    """What a handler reads as the engine produces: token counts and the cache hit."""

    prompt_ids: list[int]
    max_tokens: int
    finish_reason: str
    generated: int = 0
    cached_tokens: int = 0
    finished: bool = False
    aborted: bool = False


@dataclass
class _Parsed:
    body: dict[str, Any]  # the client's JSON
    request: Any  # its validated model (router.requests)
    stream: bool
    include_usage: bool
    continuous_usage: bool
    base_id: str  # X-Request-Id, or a fresh uuid: response ids are cmpl-<it> / chatcmpl-<it>
    created: int = field(default_factory=lambda: int(time.time()))


class EmulatedReplica:
    """One emulated vLLM replica.  ``await start()`` binds its sockets (``url``, ``port``,
    ``events_endpoint`` and ``replay_endpoint`` are known from then on), ``await stop()`` releases
    them; it is also an async context manager.  Passing ``tokenizer`` lets replicas share one."""

    def __init__(self, config: ReplicaConfig, *, tokenizer: Tokenizer | None = None):
        self.config = config
        self.model = config.model
        self.profile = config.timing_profile()
        self.block_size = self.profile.block_size
        self.num_gpu_blocks = self.profile.num_gpu_blocks
        capacity_tokens = self.block_size * (self.num_gpu_blocks - 1)  # vLLM's null block holds nothing
        self.max_model_len = config.max_model_len or min(DEFAULT_MAX_MODEL_LEN, capacity_tokens)
        if self.max_model_len > capacity_tokens:
            # vLLM refuses to start when one sequence could not fit in the KV cache.
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the KV cache ({capacity_tokens} tokens)")
        self.tokenizer = tokenizer or Tokenizer.from_dir(config.tokenizer_dir or default_tokenizer_dir())
        self.filler = Filler(self.tokenizer)
        self.clock = VirtualClock(config.time_scale)
        self._pending_events: list[WireEvent] = []
        self.engine = EmulatedEngine(self.profile, on_kv_event=self._on_kv_event)
        self._seed = namespace_seed(self.model)
        # cache_salt of a salted chain's first block: vLLM lists it in that block's extra_keys.
        self._salt_of_root: dict[int, str] = {}
        self._live: dict[str, _Live] = {}
        self._ids = itertools.count()
        self._wake = asyncio.Event()
        self._driver: asyncio.Task | None = None
        self._dead: Exception | None = None  # set if the engine failed: health 503, requests refused
        self._runner: web.AppRunner | None = None
        self.publisher: KVEventPublisher | None = None
        if config.events_endpoint:
            self.publisher = KVEventPublisher(config.events_endpoint, config.replay_endpoint, topic=config.events_topic)
        self.started_at = time.time()
        self.url = ""
        self.port = 0
        self.metrics = ReplicaMetrics(self.model, self.engine, cache_config_labels(self.block_size, self.num_gpu_blocks),
                                      lambda: self.started_at)
        self.app = self._make_app()

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self.publisher is not None:
            await self.publisher.start()
        # handler_cancellation: a client that disconnects cancels its handler, which aborts its
        # request in the engine (frees its blocks, stops its decode), as vLLM does.
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None,
                                     shutdown_timeout=SHUTDOWN_GRACE_S)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        try:
            await site.start()
        except OSError:
            await self._runner.cleanup()
            if self.publisher is not None:
                await self.publisher.close()
            raise
        self.port = site._server.sockets[0].getsockname()[1]  # noqa: SLF001 - the bound port (0 asked for any)
        host = self.config.host if self.config.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        self.url = f"http://{host}:{self.port}"
        self.started_at = time.time()
        self._driver = asyncio.get_running_loop().create_task(self._drive(), name=f"replica-driver-{self.port}")

    async def stop(self) -> None:
        """Stop serving: in-flight requests get a short grace period (the engine keeps running
        through it), then are cut; the event sockets close last."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._driver is not None:
            self._driver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._driver
            self._driver = None
        if self.publisher is not None:
            await self.publisher.close()

    async def __aenter__(self) -> EmulatedReplica:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def events_endpoint(self) -> str | None:
        return self.publisher.endpoint if self.publisher else None

    @property
    def replay_endpoint(self) -> str | None:
        return self.publisher.replay_endpoint if self.publisher else None

    # ------------------------------------------------------------------ engine driving

    def _on_kv_event(self, event: kv_events.KVEvent) -> None:
        self._pending_events.append(self._to_wire(event))

    def _to_wire(self, event: kv_events.KVEvent) -> WireEvent:
        if isinstance(event, kv_events.BlockStored):
            extra: list[tuple[Any, ...] | None] = [None] * len(event.block_hashes)
            if event.parent_block_hash is None and event.block_hashes:
                salt = self._salt_of_root.get(event.block_hashes[0])
                if salt is not None:
                    extra[0] = (salt,)
            return BlockStored(block_hashes=list(event.block_hashes), parent_block_hash=event.parent_block_hash,
                               token_ids=list(event.token_ids), block_size=event.block_size, lora_id=None,
                               medium=MEDIUM_GPU, lora_name=None, extra_keys=extra, group_idx=0,
                               kv_cache_spec_kind="full_attention")
        if isinstance(event, kv_events.BlockRemoved):
            return BlockRemoved(block_hashes=list(event.block_hashes), medium=MEDIUM_GPU, group_idx=0)
        return AllBlocksCleared()

    def _flush_events(self) -> None:
        """Publish what the engine emitted since the last flush as one batch (one step's worth)."""
        if not self._pending_events:
            return
        events, self._pending_events = self._pending_events, []
        if self.publisher is not None:
            self.publisher.publish(events)

    def _dispatch(self, updates: list[EngineUpdate]) -> None:
        for update in updates:
            live = self._live.get(update.request_id)
            if live is None:  # its client is gone
                continue
            if update.kind == "first_token" and live.first_token_at is None:
                live.first_token_at = update.time
                self.metrics.first_token(update.time - live.arrival)
            elif update.kind == "finished":
                self.metrics.finished(update.time - live.arrival, live.finish_reason)
            elif update.kind == "tokens" and not live.streaming:
                # Waking a handler costs a trip through its whole coroutine stack: one that
                # answers once at the end only needs the count.
                live.unseen_tokens += update.new_tokens
                continue
            live.queue.put_nowait(update)

    def _run_due(self) -> None:
        """Run every step completing by now, one at a time so each step's events form one batch."""
        now = self.clock.now()
        for _ in range(10_000):  # bounded: the loop yields to the event loop between rounds
            due = self.engine.next_step_time()
            if due is None or (due > now and self.clock.scale != 0):
                return
            self.clock.advance_to(due)
            updates = self._run_step(due)
            self._flush_events()
            self._dispatch(updates)
            if self.clock.scale == 0:
                return  # instant mode: one step per round, so arrivals join the next step

    def _run_step(self, due: float) -> list[EngineUpdate]:
        """``run_until(due)`` for the step ending at ``due``, guarded: should rounding ever leave
        that step unfinished (an engine that recomputes step ends can land a hair above the time
        it reported), ``due`` is nudged up by a few ulps rather than spinning the driver."""
        updates = self.engine.run_until(due)
        target = due
        for _ in range(64):
            following = self.engine.next_step_time()
            if following is None or following > due:
                break
            target = math.nextafter(target, math.inf)
            updates += self.engine.run_until(target)
        else:
            raise RuntimeError(f"the engine does not advance past t={due!r}")
        return updates

    async def _drive(self) -> None:
        while True:
            due = self.engine.next_step_time()
            if due is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            delay = self.clock.wall_delay(due)
            if delay > 0:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    # not wait_for: Python 3.11's swallows a cancellation racing the wake-up
                    async with asyncio.timeout(delay):
                        await self._wake.wait()
                continue  # re-read the schedule: an arrival may have changed it
            try:
                self._run_due()
            except Exception as exc:  # noqa: BLE001 - a bug; without the driver every request hangs
                log.exception("emulated engine step failed: the replica is dead")
                self._dead = exc
                for request_id, live in self._live.items():  # end every request rather than hang it
                    live.queue.put_nowait(EngineUpdate(request_id, "aborted", self.clock.now()))
                return
            await asyncio.sleep(0)

    async def _generate(self, ids: list[int], max_tokens: int, finish_reason: str, cache_salt: str | None,
                        streaming: bool) -> AsyncIterator[tuple[_Generation, int]]:
        """Submit a prompt; yield (state, new token count) as its steps complete.  Leaving early
        (client gone) aborts the request in the engine."""
        request_id = f"r{next(self._ids)}"
        seed = namespace_seed(self.model, None, cache_salt) if cache_salt else self._seed
        hashes = block_hashes(ids, self.block_size, seed)
        if cache_salt and hashes:
            self._remember_salt(hashes[0], cache_salt)
        live = _Live(asyncio.Queue(), self.clock.now(), finish_reason, streaming)
        self.engine.submit(EngineRequest(request_id, hashes, len(ids), max_tokens, token_ids=ids), live.arrival)
        self._live[request_id] = live
        self._catch_up()
        gen = _Generation(ids, max_tokens, finish_reason)
        try:
            while not (gen.finished or gen.aborted):
                update = await live.queue.get()
                new = min(update.new_tokens + live.unseen_tokens, max_tokens - gen.generated)
                live.unseen_tokens = 0
                gen.generated += new
                if update.kind in ("first_token", "finished"):
                    gen.cached_tokens = update.cached_tokens or gen.cached_tokens
                gen.finished = update.kind == "finished"
                gen.aborted = update.kind == "aborted"
                yield gen, new
        finally:
            self._live.pop(request_id, None)
            if not (gen.finished or gen.aborted):
                self.engine.abort(request_id, self.clock.now())
                self.metrics.aborted()
                self._catch_up()

    def _catch_up(self) -> None:
        """After a submit or an abort: deliver what the engine did to reach the present (it may
        have completed a step the driver had not run yet), and let the driver re-plan."""
        updates = self.engine.run_until(self.clock.now())
        self._flush_events()
        self._dispatch(updates)
        self._wake.set()

    def _remember_salt(self, root: int, salt: str) -> None:
        salts = self._salt_of_root
        salts.pop(root, None)
        salts[root] = salt
        while len(salts) > 4 * self.num_gpu_blocks:  # a bound: roots outlive no more than the cache
            del salts[next(iter(salts))]

    # ------------------------------------------------------------------ HTTP app

    def _make_app(self) -> web.Application:
        app = web.Application(middlewares=[error_middleware, self._auth_middleware], client_max_size=64 * 2**20)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
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
        key = self.config.api_key
        if key and request.path.startswith("/v1"):
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
                raise ReplicaError(401, "Unauthorized")
        return await handler(request)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model:
            raise ReplicaError(404, f"The model `{model}` does not exist.", param="model")

    async def _parse(self, request: web.Request, kind: str) -> _Parsed:
        if self._dead is not None:
            raise ReplicaError(503, f"engine dead: {self._dead!r}", type="EngineDeadError")
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
        gen = self._generate(ids, max_tokens, reason, p.request.cache_salt, p.stream)
        if p.stream:
            return await self._stream(request, p, gen, CompletionShapes(p.base_id, p.created, self.model))
        return await self._collect(gen, CompletionShapes(p.base_id, p.created, self.model))

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        p = await self._parse(request, "chat")
        ids = await self._encode_chat(p.body)
        req = p.request
        value = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens, reason = self._max_tokens(value, len(ids), self.config.default_max_tokens, "stop")
        gen = self._generate(ids, max_tokens, reason, req.cache_salt, p.stream)
        if p.stream:
            return await self._stream(request, p, gen, ChatShapes(p.base_id, p.created, self.model))
        return await self._collect(gen, ChatShapes(p.base_id, p.created, self.model))

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

    async def _collect(self, gen: AsyncIterator[tuple[_Generation, int]], shapes: Shapes) -> web.Response:
        state: _Generation | None = None
        async with contextlib.aclosing(gen):
            async for state, _ in gen:
                pass
        assert state is not None
        text = self.filler.text(len(state.prompt_ids), 0, state.generated)
        reason = "abort" if state.aborted else state.finish_reason
        body = shapes.full(text, reason, _usage(state))
        return web.Response(text=dumps(body), content_type="application/json")

    async def _stream(self, request: web.Request, p: _Parsed, gen: AsyncIterator[tuple[_Generation, int]],
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
        created = int(self.started_at)
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
        if self._dead is not None:
            raise ReplicaError(503, f"engine dead: {self._dead!r}", type="EngineDeadError")
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
        if not self.engine.reset_prefix_cache():
            raise ReplicaError(409, "requests are running: the prefix cache was not reset")
        self._flush_events()
        return web.Response(status=200)


def _optional_str(body: dict[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise ReplicaError(400, f"{key} must be a string", param=key)
    return value


def _usage(state: _Generation, *, exclude_none: bool = False) -> dict[str, Any]:
    return usage(len(state.prompt_ids), state.generated, state.cached_tokens, exclude_none=exclude_none)


async def _echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    request_id = request.get(REQUEST_ID) or request.headers.get("X-Request-Id")
    if request_id:
        response.headers["X-Request-Id"] = request_id
