"""The demo's fleet: a router in front of replicas on loopback, started and stopped as one unit.

The replica backend is swappable: anything with the `ReplicaFleet` shape (``urls``, ``model``,
``describe()``, ``async start()``, ``async stop()``) can stand behind the router.  `EmulatedFleet`
runs emulated replicas in this process (one shared tokenizer; the engines' timing profile sped
up or slowed down by ``time_scale``).  `--engine vllm` (`make demo-vllm`) plugs in through
``kvroute.replica.vllm.demo_fleet(count, model=..., time_scale=..., profile=...)``: real vLLM replicas
(replica/vllm_fleet.py), which ignore the emulated options.  Building a fleet starts nothing:
``start()`` does; a start that cannot succeed raises `FleetError` (or `OSError`), saying why.

Optional parts of the shape: ``tokenizer_dir``, the tokenizer the replicas use (the router
must cut prompts into the very same tokens; default: the tiny tokenizer); ``async
reset_caches()``, which empties the replicas' prefix caches in place: a fleet that has it is
started once and reset before every pass (`running_fleet`, `router_stack`), instead of started
afresh per pass (`demo_stack`); and ``entries``, the replicas as the router's config names them
with their KV-event endpoints (``{url, events_endpoint, replay_endpoint}``), which the router
then follows as it would any vLLM replica's.  The emulated replicas all live on 127.0.0.1, where
the events-port convention cannot tell them apart: each publishes on free ports of its own, and
the router is told which (no Redis involved).

`demo_stack` starts the replicas first and the router after them (its first health round then
finds them up), and stops everything it started, in reverse order, whatever happens in between:
an error, a cancellation (Ctrl-C), a failed start.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import aiohttp

from kvroute.replica.assets import TINY_TOKENIZER
from kvroute.replica.vllm_fleet import FleetError  # noqa: F401 - what a fleet's start() raises: the demo reports it
from kvroute.router.app import RouterApp
from kvroute.router.config import RouterSettings


TOKENIZER_DIR = TINY_TOKENIZER  # the router's, unless the fleet names its own
ENGINES = ("emulated", "vllm")


class EngineUnavailable(RuntimeError):
    """The requested replica engine cannot run here (not built yet, not installed)."""


class ReplicaFleet(Protocol):
    model: str
    urls: list[str]

    def describe(self) -> str: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class EmulatedFleet:
    """``count`` emulated vLLM replicas in this process, on free loopback ports."""

    def __init__(
        self,
        count: int,
        *,
        model: str,
        time_scale: float,
        profile: str = "default",
        tokenizer_dir: Path = TOKENIZER_DIR,
        max_model_len: int | None = None,  # None: the replica's default (min(32768, KV capacity))
    ):
        if count < 1:
            raise ValueError("a fleet needs at least one replica")
        self.count = count
        self.model = model
        self.time_scale = time_scale
        self.profile = profile
        self.tokenizer_dir = tokenizer_dir
        self.max_model_len = max_model_len
        self.urls: list[str] = []
        self.entries: list[dict[str, str]] = []  # with their KV-event endpoints, once started
        self._replicas: list[Any] = []

    def describe(self) -> str:
        return f"{self.count} emulated replicas (profile {self.profile}, time scale {self.time_scale:g})"

    async def start(self) -> None:
        from kvroute.replica.emulated.server import EmulatedReplica, ReplicaConfig
        from kvroute.common.tokens import Tokenizer

        # One tokenizer for all replicas, built fresh for every fleet: its segment cache is
        # part of the cold start (a second pass must not find the first pass's text tokenized).
        tokenizer = Tokenizer.from_dir(self.tokenizer_dir)
        config = ReplicaConfig(
            model=self.model, host="127.0.0.1", port=0, tokenizer_dir=str(self.tokenizer_dir),
            profile=self.profile, time_scale=self.time_scale, max_model_len=self.max_model_len,
            events_endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",  # free ports, bound
        )
        try:
            for _ in range(self.count):
                replica = EmulatedReplica(config, tokenizer=tokenizer)
                await replica.start()
                self._replicas.append(replica)
        except BaseException:
            await self.stop()
            raise
        self.urls = [r.url for r in self._replicas]
        self.entries = [
            {"url": r.url, "events_endpoint": r.events_endpoint, "replay_endpoint": r.replay_endpoint}
            for r in self._replicas
        ]

    async def stop(self) -> None:
        replicas, self._replicas = self._replicas, []
        for replica in reversed(replicas):
            await replica.stop()


FleetFactory = Callable[..., ReplicaFleet]


def fleet_factory(engine: str) -> FleetFactory:
    """What builds a fleet of ``engine`` replicas: ``factory(count, model=..., time_scale=...,
    profile=...)``.  Raises `EngineUnavailable` when the engine cannot run here."""
    if engine == "emulated":
        return EmulatedFleet
    if engine == "vllm":
        from kvroute.replica.vllm import demo_fleet

        return demo_fleet
    raise EngineUnavailable(f"unknown engine {engine!r}; choose from {', '.join(ENGINES)}")


def make_fleet(engine: str, count: int, *, model: str, time_scale: float, profile: str = "default", **engine_options: Any) -> ReplicaFleet:
    """A fleet, not started yet (building one starts nothing: ``start()`` does).  ``engine_options``
    go to that engine's factory only (emulated: ``max_model_len``)."""
    return fleet_factory(engine)(count, model=model, time_scale=time_scale, profile=profile, **engine_options)


def resets_in_place(fleet: ReplicaFleet) -> bool:
    """Whether the fleet can empty its replicas' prefix caches without a restart."""
    return callable(getattr(fleet, "reset_caches", None))


def replica_entries(fleet: ReplicaFleet) -> list[str | dict[str, str]]:
    """What the router is told of the fleet's replicas: their KV-event endpoints too, when the
    fleet says where they are (started fleets only); else their URLs."""
    return list(getattr(fleet, "entries", None) or fleet.urls)


def publishes_events(fleet: ReplicaFleet) -> bool:
    return bool(getattr(fleet, "entries", None))


def tokenizer_of(fleet: ReplicaFleet) -> Path:
    """The tokenizer the fleet's replicas use, which the router must use too (known once started)."""
    return Path(getattr(fleet, "tokenizer_dir", None) or TOKENIZER_DIR)


@dataclass
class DemoStack:
    router: RouterApp
    fleet: ReplicaFleet

    @property
    def url(self) -> str:
        return self.router.url


def router_settings(
    policy: str,
    replicas: list[str | dict[str, str]],
    *,
    port: int = 0,
    policy_options: Mapping[str, Any] | None = None,
    tokenizer_dir: Path = TOKENIZER_DIR,
) -> RouterSettings:
    """The demo router: loopback, the given policy, an in-memory index (so every pass starts cold),
    no client keys; the replicas' tokenizer (exact block hashes); their KV events where
    ``replicas`` names the endpoints (nothing by convention: the demo knows where they are)."""
    return RouterSettings(
        host="127.0.0.1",
        port=port,
        replicas=replicas,
        tokenizer=str(tokenizer_dir),
        policy=policy,
        policy_options=dict(policy_options or {}),
        redis_url=None,
        api_keys=[],
        tenant_isolation=False,
        log_level="warning",
        health_requires_replica=True,  # --serve: /health is 200 only once a replica can answer
        # Load scraped twice a second (runs are short); health probes patient, since the replicas
        # share this process's event loop: a busy machine delays their answers, it does not kill them.
        fleet={"health_interval_s": 2.0, "health_timeout_s": 5.0, "metrics_interval_s": 0.5, "metrics_timeout_s": 5.0,
               "events_port": 0},
    )


@contextlib.asynccontextmanager
async def running_fleet(fleet: ReplicaFleet) -> AsyncIterator[ReplicaFleet]:
    """The fleet started, and stopped on the way out (an error, a cancellation, a failed start:
    the fleet's own start() stops what it started before it raises)."""
    await fleet.start()
    try:
        yield fleet
    finally:
        await fleet.stop()


@contextlib.asynccontextmanager
async def router_stack(
    policy: str,
    fleet: ReplicaFleet,
    *,
    port: int = 0,
    policy_options: Mapping[str, Any] | None = None,
    ready_timeout_s: float = 30.0,
) -> AsyncIterator[DemoStack]:
    """A fresh router in front of a started fleet; yields once the router's /ready answers 200."""
    settings = router_settings(policy, replica_entries(fleet), port=port, policy_options=policy_options,
                               tokenizer_dir=tokenizer_of(fleet))
    router = RouterApp(settings)
    await router.start()
    try:
        await wait_ready(router.url, ready_timeout_s)
        yield DemoStack(router, fleet)
    finally:
        await router.stop()


@contextlib.asynccontextmanager
async def demo_stack(policy: str, fleet: ReplicaFleet, **router_options: Any) -> AsyncIterator[DemoStack]:
    """Replicas, then a router in front of them (``router_options``: `router_stack`'s port,
    policy_options, ready_timeout_s); yields once the router's /ready answers 200."""
    async with running_fleet(fleet), router_stack(policy, fleet, **router_options) as stack:
        yield stack


async def wait_ready(url: str, timeout_s: float) -> None:
    """Poll ``url``/ready until 200 (a replica is healthy and the router takes work)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    last = "no answer"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as session:
        while True:
            try:
                async with session.get(url + "/ready") as resp:
                    if resp.status == 200:
                        return
                    last = f"HTTP {resp.status}: {(await resp.text())[:200]}"
            except (aiohttp.ClientError, TimeoutError) as exc:
                last = repr(exc)
            if loop.time() >= deadline:
                raise TimeoutError(f"the router at {url} was not ready within {timeout_s:g} s ({last})")
            await asyncio.sleep(0.1)
