"""The engine driver: runs the emulated engine in real time and carries requests in and tokens out.

The engine runs on a virtual clock, ``virtual = wall elapsed / time_scale``.  The driver task
sleeps until the in-progress step's completion time, runs the engine to it, publishes that step's
KV events as one batch (vLLM publishes once per step) and hands each request its new tokens; a new
request wakes it.  ``time_scale`` 0.1 runs ten times faster than the profile; 0 runs steps back to
back (answers at once, for measuring what sits in front of the replica).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from kvroute.common.blocks import block_hashes, namespace_seed

from kvroute.replica.emulated.engine import EmulatedEngine, EngineRequest, EngineUpdate
from kvroute.replica.emulated.event_wire import EventWire
from kvroute.replica.emulated.vllm_metrics import ReplicaMetrics

log = logging.getLogger("kvroute.replica")


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
class Generation:
    """What a handler reads as the engine produces: token counts and the cache hit."""

    prompt_ids: list[int]
    max_tokens: int
    finish_reason: str
    generated: int = 0
    cached_tokens: int = 0
    finished: bool = False
    aborted: bool = False


class EngineDriver:
    """Owns the engine's schedule: ``start()`` runs the driver task, ``generate()`` submits a
    request and yields its progress, ``dead`` is set once a step failed (every request then ends)."""

    def __init__(self, engine: EmulatedEngine, clock: VirtualClock, wire: EventWire, metrics: ReplicaMetrics,
                 model: str, block_size: int):
        self.engine = engine
        self.clock = clock
        self.wire = wire
        self.metrics = metrics
        self.model = model
        self.block_size = block_size
        self._seed = namespace_seed(model)
        self._live: dict[str, _Live] = {}
        self._ids = itertools.count()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.dead: Exception | None = None  # set if the engine failed: health 503, requests refused

    def start(self, name: str) -> None:
        self._task = asyncio.get_running_loop().create_task(self._drive(), name=name)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def generate(self, ids: list[int], max_tokens: int, finish_reason: str, cache_salt: str | None,
                       streaming: bool) -> AsyncIterator[tuple[Generation, int]]:
        """Submit a prompt; yield (state, new token count) as its steps complete.  Leaving early
        (client gone) aborts the request in the engine."""
        request_id = f"r{next(self._ids)}"
        seed = namespace_seed(self.model, None, cache_salt) if cache_salt else self._seed
        hashes = block_hashes(ids, self.block_size, seed)
        if cache_salt and hashes:
            self.wire.remember_salt(hashes[0], cache_salt)
        live = _Live(asyncio.Queue(), self.clock.now(), finish_reason, streaming)
        self.engine.submit(EngineRequest(request_id, hashes, len(ids), max_tokens, token_ids=ids), live.arrival)
        self._live[request_id] = live
        self._catch_up()
        gen = Generation(ids, max_tokens, finish_reason)
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

    def reset_prefix_cache(self) -> bool:
        """The engine's reset (refused while requests hold blocks); its events go out at once."""
        if not self.engine.reset_prefix_cache():
            return False
        self.wire.flush()
        return True

    # ------------------------------------------------------------------ the loop

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
                self.dead = exc
                for request_id, live in self._live.items():  # end every request rather than hang it
                    live.queue.put_nowait(EngineUpdate(request_id, "aborted", self.clock.now()))
                return
            await asyncio.sleep(0)

    def _run_due(self) -> None:
        """Run every step completing by now, one at a time so each step's events form one batch."""
        now = self.clock.now()
        for _ in range(10_000):  # bounded: the loop yields to the event loop between rounds
            due = self.engine.next_step_time()
            if due is None or (due > now and self.clock.scale != 0):
                return
            self.clock.advance_to(due)
            updates = self._run_step(due)
            self.wire.flush()
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

    def _catch_up(self) -> None:
        """After a submit or an abort: deliver what the engine did to reach the present (it may
        have completed a step the driver had not run yet), and let the driver re-plan."""
        updates = self.engine.run_until(self.clock.now())
        self.wire.flush()
        self._dispatch(updates)
        self._wake.set()

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
