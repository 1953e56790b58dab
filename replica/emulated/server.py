"""The emulated replica: an HTTP server that speaks vLLM's OpenAI protocol, driven in real time by
the emulated engine, publishing KV cache events in vLLM's wire format.

What a client sees is what a vLLM server with ``--enable-prefix-caching --enable-prompt-tokens-details
--kv-events-config ...`` shows: the same endpoints, response shapes, SSE framing, error shape,
metric names and KV events.  What it computes is the emulation: prompts are tokenized for real
(the model's tokenizer and chat template), their blocks go through the engine's prefix cache, and
tokens come out as deterministic filler text at the times the engine's steps complete.

This module assembles one replica from its parts: the HTTP handlers (``handlers``), the engine
driver that runs the engine on a virtual clock (``driver``) and the KV-event wire (``event_wire``,
over ``publisher``'s ZMQ sockets).  Latency metrics are in virtual seconds: what the emulated GPU
would report.

Many replicas fit in one process: each has its own aiohttp runner, Prometheus registry, engine and
ZMQ sockets (``EmulatedReplica(config)``, ``await start()``, ``url``, ``await stop()``).
"""

from __future__ import annotations

import ssl
import time
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from kvroute.replica.assets import TINY_TOKENIZER
from kvroute.common.tls import server_context
from kvroute.common.tokens import Tokenizer

from kvroute.replica.emulated.driver import EngineDriver, VirtualClock
from kvroute.replica.emulated.engine import EmulatedEngine
from kvroute.replica.emulated.event_wire import EventWire
from kvroute.replica.emulated.handlers import ReplicaHandlers
from kvroute.replica.emulated.profile import DEFAULT_PROFILE, PROFILES, TimingProfile
from kvroute.replica.emulated.publisher import KVEventPublisher
from kvroute.replica.emulated.vllm_metrics import ReplicaMetrics, cache_config_labels

SHUTDOWN_GRACE_S = 1.0  # in-flight requests finish within this on stop(), else are cut
DEFAULT_MAX_MODEL_LEN = 32768


def default_tokenizer_dir() -> Path:
    """The project's tiny tokenizer, shipped in the package (replica/assets)."""
    return TINY_TOKENIZER


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
    events_endpoint: str | None = None  # e.g. tcp://*:5557 (bind, on ``host``) or tcp://router:5557 (connect)
    replay_endpoint: str | None = None
    events_topic: str = "kv"
    api_key: str | None = None
    time_scale: float = 1.0
    default_max_tokens: int = 16  # chat requests without max_tokens "stop" after this many tokens
    # HTTPS, with vLLM's flag names (--ssl-certfile, --ssl-keyfile, --ssl-ca-certs, --ssl-cert-reqs:
    # 0 no client certificate, 1 optional, 2 required, as the ssl module's CERT_* values)
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0

    def tls(self) -> ssl.SSLContext | None:
        """The listener's TLS context (None: plain HTTP); a bad file raises a ValueError naming it."""
        if not self.ssl_certfile and not self.ssl_keyfile:
            return None
        if not (self.ssl_certfile and self.ssl_keyfile):
            raise ValueError("--ssl-certfile and --ssl-keyfile go together")
        return server_context(Path(self.ssl_certfile), Path(self.ssl_keyfile),
                              client_ca=Path(self.ssl_ca_certs) if self.ssl_ca_certs else None,
                              require_client_cert=self.ssl_cert_reqs == ssl.CERT_REQUIRED,
                              names=("--ssl-certfile", "--ssl-keyfile", "--ssl-ca-certs"))

    def timing_profile(self) -> TimingProfile:
        if self.profile not in PROFILES:
            raise ValueError(f"unknown profile {self.profile!r}; known: {', '.join(sorted(PROFILES))}")
        profile = PROFILES[self.profile]
        overrides = {k: v for k, v in (("block_size", self.block_size), ("num_gpu_blocks", self.num_gpu_blocks))
                     if v is not None}
        return profile.replace(**overrides) if overrides else profile


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
        self.tokenizer = tokenizer or Tokenizer.load(config.tokenizer_dir or default_tokenizer_dir())
        self.publisher: KVEventPublisher | None = None
        if config.events_endpoint:
            # a wildcard bind listens where the HTTP server does: on a specific --host, as in a pod
            self.publisher = KVEventPublisher(config.events_endpoint, config.replay_endpoint, topic=config.events_topic,
                                              bind_host=config.host)
        wire = EventWire(self.publisher, self.num_gpu_blocks)
        self.engine = EmulatedEngine(self.profile, on_kv_event=wire.on_event)
        self.started_at = time.time()
        self.url = ""
        self.port = 0
        self.metrics = ReplicaMetrics(self.model, self.engine, cache_config_labels(self.block_size, self.num_gpu_blocks),
                                      lambda: self.started_at)
        self.driver = EngineDriver(self.engine, VirtualClock(config.time_scale), wire, self.metrics, self.model,
                                   self.block_size)
        self._runner: web.AppRunner | None = None
        self.handlers = ReplicaHandlers(model=self.model, max_model_len=self.max_model_len, tokenizer=self.tokenizer,
                                        driver=self.driver, metrics=self.metrics, api_key=config.api_key,
                                        default_max_tokens=config.default_max_tokens,
                                        started_at=lambda: self.started_at)
        self.app = self.handlers.make_app()

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self.publisher is not None:
            await self.publisher.start()
        # handler_cancellation: a client that disconnects cancels its handler, which aborts its
        # request in the engine (frees its blocks, stops its decode), as vLLM does.
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None,
                                     shutdown_timeout=SHUTDOWN_GRACE_S)
        await self._runner.setup()
        # a router opens its upstream connections in bursts (one per request when its pool is empty):
        # aiohttp's default backlog of 128 drops SYNs of such a burst, each then waits 1 s or more
        try:
            tls = self.config.tls()
            site = web.TCPSite(self._runner, self.config.host, self.config.port, backlog=4096, ssl_context=tls)
            await site.start()
        except (OSError, ValueError):  # a port in use, a TLS file that cannot be used
            await self._runner.cleanup()
            if self.publisher is not None:
                await self.publisher.close()
            raise
        self.port = site._server.sockets[0].getsockname()[1]  # noqa: SLF001 - the bound port (0 asked for any)
        host = self.config.host if self.config.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        self.url = f"{'https' if tls is not None else 'http'}://{host}:{self.port}"
        self.started_at = time.time()
        self.driver.start(name=f"replica-driver-{self.port}")

    async def stop(self) -> None:
        """Stop serving: in-flight requests get a short grace period (the engine keeps running
        through it), then are cut; the event sockets close last."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.driver.stop()
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
