"""The one way the router talks to its prefix index (after llm-d's instrumented index; docs/design.md §3.6).

Every caller (routing, the fleet, the KV-event streams, the metrics endpoint) goes through an
``IndexClient``.  Each call of a shared (Redis) backend gets a budget (``timeout_s`` for a lookup,
``write_timeout_s`` for the rest) and a verdict: a failure is counted in
``kvroute_index_errors_total{op, kind}``, never raised, and after ``SKIP_AFTER_FAILURES`` in a row
calls skip the index until the refresh gets an answer (in a client nobody started, one call every
``refresh_s`` probes instead).  ``record_prediction`` only queues its write (bounded; a full queue
drops it, counted) for a few writer tasks, so a request never waits for it.  Every ``refresh_s``
the client renews its replicas' keys and reads the store's epoch; another epoch means Redis lost
its state: it registers its replicas again, counts ``kvroute_index_rebuilds_total`` and calls its
``on_rebuild`` listeners (the KV-event streams replay), and a write that finds its replica unregistered asks for that check at once.

A ``MemoryIndex`` is called directly and synchronously (no budget, no task, no timing): it never
waits on I/O.

The other writes (the fleet's registrations, the KV-event streams' confirm / remove / clear) are
awaited by their callers within ``write_timeout_s``: none runs on a request's path, and each caller
needs the verdict.  A KV-event stream's writes must land in order, and one that fails makes it
resync from the replica's replay buffer, which a write dropped silently from a queue could not.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvroute.router.aio import cancel_and_wait

from kvroute.router.index.base import PrefixIndex, ReplicaSpec
from kvroute.router.index.memory import MemoryIndex
from kvroute.router.index.metrics import IndexMetrics

log = logging.getLogger("kvroute.index")

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 0.2
WRITE_QUEUE_SIZE = 1024  # writes waiting to be sent; beyond, new ones are dropped
WRITERS = 4  # writes in flight at once
REFRESH_S = 1.0  # epoch check and key renewal
SKIP_AFTER_FAILURES = 3  # timeouts or connection failures in a row before calls skip the index
_FAILED: Any = object()


def error_kind(exc: BaseException) -> str:
    if isinstance(exc, (TimeoutError, RedisTimeoutError)):
        return "timeout"
    if isinstance(exc, (RedisConnectionError, OSError)):
        return "connection"
    return "error"


class IndexClient:
    def __init__(
        self,
        backend: PrefixIndex,
        *,
        metrics: IndexMetrics | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        write_timeout_s: float | None = None,
        queue_size: int = WRITE_QUEUE_SIZE,
        writers: int = WRITERS,
        refresh_s: float = REFRESH_S,
    ):
        self.backend = backend
        self.metrics = metrics or IndexMetrics()
        self.timeout_s = timeout_s
        self.write_timeout_s = write_timeout_s if write_timeout_s is not None else 5 * timeout_s
        self.refresh_s = refresh_s
        self._local = backend if isinstance(backend, MemoryIndex) else None
        self._queue: asyncio.Queue[tuple[str, Callable[..., Awaitable[Any]], tuple[Any, ...]]]
        self._queue = asyncio.Queue(queue_size)
        self._writers_wanted = writers
        self._writers: list[asyncio.Task[None]] = []
        self._refresher: asyncio.Task[None] | None = None
        self._specs: dict[str, ReplicaSpec] = {}  # what this router registered: registered again after a rebuild
        self._epoch: str | None = None
        self._check_now = asyncio.Event()
        self._rebuild_listeners: list[Callable[[], None]] = []
        self._failures = 0  # timeouts and connection failures in a row
        self._skip_until = 0.0  # while failing: calls skip the index until then, but for one probe
        self._stopped = False
        self._refresh_probes = False  # the refresh loop runs: calls that fail never probe
        self.metrics.watch_write_queue(self._queue.qsize)
        self._latency: dict[str, Any] = {}  # op -> its histogram child, bound once

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        """Learn the store's epoch now, then refresh it in the background (shared backends)."""
        if self._local is not None or self._refresher is not None:
            return
        if not self._writers:
            self._start_writers()
        await self._refresh()
        self._refresh_probes = True
        self._refresher = asyncio.create_task(self._refresh_loop(), name="index-refresh")

    async def stop(self) -> None:
        """Stop the writers (queued writes are dropped) and the refresh; the backend stays open."""
        self._stopped = True
        self._refresh_probes = False
        tasks = [*self._writers, *([self._refresher] if self._refresher else [])]
        self._writers, self._refresher = [], None
        await cancel_and_wait(tasks)

    def on_rebuild(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` once this router's replicas are registered again in an emptied store."""
        self._rebuild_listeners.append(callback)

    # -- the request path ---------------------------------------------------------------------
    async def lookup(self, chain: Sequence[int]) -> dict[str, int]:
        """Matches per replica; {} when the index fails or takes longer than ``timeout_s``."""
        if self._local is not None:
            return self._local.lookup_now(chain)
        if not chain:
            return {}
        found = await self._call("lookup", self.backend.lookup, (chain,), self.timeout_s)
        return {} if found is _FAILED else found

    def record_prediction(self, replica: str, chain: Sequence[int]) -> None:
        """Never waits: applied at once in process, else queued for a writer."""
        if self._local is not None:
            self._local.record_prediction_now(replica, chain)
        elif chain:
            self._submit("record_prediction", self._record_prediction, (replica, chain))

    # -- background callers: awaited, bounded, never raising -----------------------------------
    async def add_replica(self, spec: ReplicaSpec) -> bool:
        self._specs[spec.name] = spec
        return await self._write("add_replica", self.backend.add_replica, spec)

    async def remove_replica(self, name: str) -> bool:
        self._specs.pop(name, None)
        return await self._write("remove_replica", self.backend.remove_replica, name)

    async def clear_replica(self, name: str) -> bool:
        return await self._write("clear_replica", self.backend.clear_replica, name)

    async def drop_confirmed(self, name: str) -> bool:
        return await self._write("drop_confirmed", self.backend.drop_confirmed, name)

    async def confirm(self, replica: str, hashes: Sequence[int]) -> bool:
        """True once written, or if the replica is not registered (then a rebuild check runs)."""
        return await self._write("confirm", self._confirm, replica, hashes)

    async def remove(self, replica: str, hashes: Sequence[int]) -> bool:
        return await self._write("remove", self.backend.remove, replica, hashes)

    async def entry_count(self, name: str) -> int | None:
        if self._local is not None:
            return await self._local.entry_count(name)
        count = await self._call("entry_count", self.backend.entry_count, (name,), self.timeout_s)
        return None if count is _FAILED else count

    # -- internals ----------------------------------------------------------------------------
    async def _write(self, op: str, fn: Callable[..., Awaitable[Any]], *args: Any) -> bool:
        if self._local is not None:
            await fn(*args)
            return True
        return await self._call(op, fn, args, self.write_timeout_s) is not _FAILED

    async def _record_prediction(self, replica: str, chain: Sequence[int]) -> None:
        if not await self.backend.record_prediction(replica, chain) and await self._registered_again(replica):
            await self.backend.record_prediction(replica, chain)

    async def _confirm(self, replica: str, hashes: Sequence[int]) -> None:
        if not await self.backend.confirm(replica, hashes) and await self._registered_again(replica):
            await self.backend.confirm(replica, hashes)

    async def _registered_again(self, replica: str) -> bool:
        """A write found ``replica`` unregistered: the store may have lost its state (the refresh
        compares epochs at once), or another router sharing it took the replica out (it saw it
        down).  This router still routes there: it registers it again, so its writes land."""
        self._check_now.set()
        spec = self._specs.get(replica)
        if spec is None:
            return False
        await self.backend.add_replica(spec)
        return True

    async def _call(self, op: str, fn: Callable[..., Awaitable[T]], args: tuple[Any, ...], timeout_s: float) -> T:
        """``fn(*args)`` within ``timeout_s``, timed and counted; ``_FAILED`` if it did not answer."""
        if self._failures >= SKIP_AFTER_FAILURES and op != "refresh":
            if self._refresh_probes or self._skipping():
                self.metrics.errors.labels(op, "unavailable").inc()
                return _FAILED
            self._skip_until = time.monotonic() + self.refresh_s  # this call probes, the others skip
        started = time.perf_counter()
        try:
            async with asyncio.timeout(timeout_s):
                value = await fn(*args)
        except Exception as exc:  # noqa: BLE001 - an index outage degrades routing, never a request
            kind = error_kind(exc)
            self.metrics.errors.labels(op, kind).inc()
            if kind == "error":
                log.warning("index %s failed: %r", op, exc)
            else:
                self._failures += 1
                if self._failures >= SKIP_AFTER_FAILURES:
                    self._skip_until = time.monotonic() + self.refresh_s
                if self._failures == SKIP_AFTER_FAILURES:
                    self.metrics.available.set(0)
                    log.warning("index unreachable (%s: %r): routing without it until it answers", op, exc)
            return _FAILED
        latency = self._latency.get(op)
        if latency is None:
            latency = self._latency[op] = self.metrics.latency.labels(op)
        latency.observe(time.perf_counter() - started)
        if self._failures:
            if self._failures >= SKIP_AFTER_FAILURES:
                self.metrics.available.set(1)
                log.warning("index answers again")
            self._failures = 0
        return value

    def _skipping(self) -> bool:
        return self._failures >= SKIP_AFTER_FAILURES and (self._refresh_probes or time.monotonic() < self._skip_until)

    def _submit(self, op: str, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...]) -> None:
        if self._skipping():
            self.metrics.errors.labels(op, "unavailable").inc()
            return
        try:
            self._queue.put_nowait((op, fn, args))
        except asyncio.QueueFull:
            self.metrics.errors.labels(op, "dropped").inc()
            return
        if not self._writers and not self._stopped:
            self._start_writers()  # a client nobody started (tests, tools): writers on first use

    def _start_writers(self) -> None:
        for i in range(self._writers_wanted):
            self._writers.append(asyncio.create_task(self._writer(), name=f"index-writer-{i}"))

    async def _writer(self) -> None:
        queue = self._queue
        while True:
            op, fn, args = await queue.get()
            await self._call(op, fn, args, self.write_timeout_s)

    async def _refresh_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.refresh_s):
                    await self._check_now.wait()
            self._check_now.clear()
            await self._refresh()

    async def _refresh(self) -> None:
        """Renew our keys, read the epoch; a new one means the store lost what we wrote."""
        token = uuid.uuid4().hex  # the epoch, should the store have none
        epoch = await self._call("refresh", self.backend.refresh, (list(self._specs), token), self.write_timeout_s)
        if epoch is _FAILED or epoch is None or epoch == self._epoch:
            return
        if self._epoch is None and not self._specs:
            self._epoch = epoch  # the first look, before this router registered anything
            return
        log.warning("the shared index lost its state (Redis restarted or flushed): registering %d replicas again",
                    len(self._specs))
        for spec in list(self._specs.values()):
            if await self._call("add_replica", self.backend.add_replica, (spec,), self.write_timeout_s) is _FAILED:
                return  # the next refresh tries again
        self._epoch = epoch
        self.metrics.rebuilds.inc()
        for callback in self._rebuild_listeners:
            try:
                callback()
            except Exception:  # noqa: BLE001 - one listener's bug must not stop the others
                log.exception("index rebuild listener failed")
