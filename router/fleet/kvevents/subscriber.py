"""The router's KV-event subscriber: one stream per replica, all writing one prefix index.

``KVEventSubscriber(index, block_size_for=fleet.block_size, registry=metrics.registry)``;
``await start()``; ``watch(name, endpoint, replay_endpoint, model)`` per replica (or
``fleet.subscribe(subscriber.on_fleet_event)``, which watches a replica with event endpoints
once it is up and stops when it goes down or leaves); ``await stop()``.  ``on_state(replica,
state)`` hears whether each followed replica's events come ("pending", "following", "silent":
router/fleet/kvevents/liveness.py), which the fleet turns into the index's event mode.

Several routers sharing one Redis index each subscribe to every replica and apply the same
events, uncoordinated: every write is idempotent (``confirm`` sets state and bumps the LRU stamp,
``remove``, ``clear_replica`` and ``drop_confirmed`` delete), so a second application changes
nothing a lookup sees (docs/design.md §4.6 says why not one elected writer).  A router that
starts (first contact) drops the replica's confirmed entries and replays its history: for a
moment every router sees fewer confirmed blocks, not stale ones.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import zmq.asyncio
from prometheus_client import CollectorRegistry

from kvroute.router.aio import cancel_and_wait
from kvroute.router.fleet.catalogue import card_parent
from kvroute.router.index.base import PrefixIndex
from kvroute.router.index.client import IndexClient

from kvroute.router.fleet.kvevents.liveness import HeardState
from kvroute.router.fleet.kvevents.metrics import KVEventMetrics
from kvroute.router.fleet.kvevents.stream import ReplicaStream, StreamStatus

if TYPE_CHECKING:
    from kvroute.router.fleet.replica import Replica

log = logging.getLogger("kvroute.kvevents")

DEFAULT_CAPACITY_BLOCKS = 65_536  # hash-map bound while a replica's KV capacity is unknown
DEFAULT_REPLAY_TIMEOUT_S = 2.0
# after a SUB socket connects, how long until its subscription surely reached the publisher (a
# round trip; generous): then what was published meanwhile is fetched from the replay endpoint
DEFAULT_SETTLE_S = 0.25
# how long a stream stays quiet after a live batch before asking whether it missed the last one
DEFAULT_IDLE_CHECK_S = 5.0
DEFAULT_MAX_CHUNK = 512
DEFAULT_SILENT_AFTER_S = 10.0


def base_model(replica: Replica) -> str | None:
    """The base model a fleet replica serves: its model card without a ``parent`` (LoRA adapters
    name the base as their parent), else its first model."""
    for card in replica.model_cards:
        if isinstance(card.get("id"), str) and card_parent(card) is None:
            return card["id"]
    models = sorted(replica.models)
    return models[0] if models else None


def reachable_endpoint(endpoint: str, replica_url: str) -> str:
    """A registered endpoint as a subscriber connects to it: vLLM's bind address
    ``tcp://*:5557`` (or 0.0.0.0, ::) names no host, so the replica's own host stands in."""
    scheme, sep, rest = endpoint.partition("://")
    host, colon, port = rest.rpartition(":")
    if scheme != "tcp" or not sep or not colon or host not in ("*", "0.0.0.0", "[::]", "::"):
        return endpoint
    replica_host = urlsplit(replica_url).hostname
    if not replica_host:
        return endpoint
    if ":" in replica_host:
        replica_host = f"[{replica_host}]"
    return f"tcp://{replica_host}:{port}"


class KVEventSubscriber:
    def __init__(
        self,
        index: IndexClient,
        *,
        block_size_for: Callable[[str], int],
        registry: CollectorRegistry | None = None,
        replay_timeout_s: float = DEFAULT_REPLAY_TIMEOUT_S,
        default_capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS,
        max_chunk: int = DEFAULT_MAX_CHUNK,
        settle_s: float = DEFAULT_SETTLE_S,
        idle_check_s: float = DEFAULT_IDLE_CHECK_S,
        context: zmq.asyncio.Context | None = None,
        topic: str = "",  # the subscription's topic prefix ("": every topic)
        silent_after_s: float = DEFAULT_SILENT_AFTER_S,
        on_state: Callable[[str, HeardState], None] | None = None,
    ) -> None:
        self.index = index
        self.index.on_rebuild(self.resync_all)
        self.block_size_for = block_size_for
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = KVEventMetrics(self.registry)
        self.replay_timeout_s = replay_timeout_s
        self.default_capacity_blocks = default_capacity_blocks
        self.max_chunk = max_chunk
        self.settle_s = settle_s
        self.idle_check_s = idle_check_s
        self.topic = topic
        self.silent_after_s = silent_after_s
        self._on_state = on_state
        self._ctx = context or zmq.asyncio.Context.instance()
        self._streams: dict[str, ReplicaStream] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._stopping: set[asyncio.Task[None]] = set()
        self._started = False
        self._changed = asyncio.Event()

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        self._started = True
        for name in self._streams:
            self._spawn(name)

    async def stop(self) -> None:
        self._started = False
        for name in list(self._streams):
            self._cancel(name)
        pending = list(self._stopping)
        await asyncio.gather(*pending, return_exceptions=True)

    async def __aenter__(self) -> KVEventSubscriber:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- replicas -------------------------------------------------------------------------
    def watch(
        self,
        replica: str,
        endpoint: str,
        replay_endpoint: str | None,
        model: str,
        *,
        capacity_blocks: int | None = None,
        bind: bool = False,
    ) -> None:
        """Follow ``replica``'s events.  ``bind``: the replica connects to us (vLLM's endpoint is a
        specific host), so this socket binds ``endpoint``.  Watching again with the same
        arguments is a no-op; with others, the old stream stops and a new one starts (first
        contact: its history is replayed)."""
        current = self._streams.get(replica)
        if current is not None and (current.endpoint, current.replay_endpoint, current.model, current.bind) == (
            endpoint, replay_endpoint, model, bind
        ):
            return
        if current is not None:
            self._cancel(replica)
        stream = self._streams[replica] = ReplicaStream(
            name=replica,
            endpoint=endpoint,
            replay_endpoint=replay_endpoint or None,
            model=model,
            capacity_blocks=capacity_blocks or self.default_capacity_blocks,
            bind=bind,
            index=self.index,
            block_size_for=self.block_size_for,
            metrics=self.metrics,
            context=self._ctx,
            on_progress=self._notify,
            replay_timeout_s=self.replay_timeout_s,
            max_chunk=self.max_chunk,
            settle_s=self.settle_s,
            idle_check_s=self.idle_check_s,
            topic=self.topic,
            silent_after_s=self.silent_after_s,
            on_heard=lambda state: self._heard(stream, state),
        )
        self._heard(stream, stream.liveness.state)
        if self._started:
            self._spawn(replica)

    def watched(self) -> list[str]:
        return list(self._streams)

    def resync_all(self) -> None:
        """The index lost its state (Redis restarted empty): every stream rebuilds its replica's
        entries from the history the replica buffers."""
        for stream in self._streams.values():
            stream.request_resync()

    def on_fleet_event(self, event: str, replica: Replica) -> None:
        """Adapter for ``Fleet.subscribe``: follow replicas that are up and publish events.

        "up": watch (the fleet has just registered it in the index, so writes land).
        "down" / "left": stop; the fleet dropped its entries, and a replica that comes back is
        watched afresh, its history replayed.  "restarted": the fleet cleared its entries; a
        fresh stream replays the new process's history.  "changed": new endpoints.
        """
        name = replica.name
        if event in ("down", "left"):
            self._cancel(name)
            return
        if event not in ("up", "changed", "restarted"):
            return
        if not replica.healthy or not replica.events_endpoint:
            self._cancel(name)
            return
        model = base_model(replica)
        if model is None:
            log.warning("replica %s publishes KV events but serves no known model: not watched", name)
            return
        if event == "restarted":
            self._cancel(name)
        replay = replica.replay_endpoint
        self.watch(
            name,
            reachable_endpoint(replica.events_endpoint, replica.url),
            reachable_endpoint(replay, replica.url) if replay else None,
            model,
            capacity_blocks=replica.capacity_blocks,
        )

    # -- observing ------------------------------------------------------------------------
    def status(self, replica: str) -> StreamStatus | None:
        stream = self._streams.get(replica)
        return stream.status() if stream is not None else None

    def statuses(self) -> list[StreamStatus]:
        return [s.status() for s in self._streams.values()]

    async def wait_until(self, predicate: Callable[[], bool], timeout: float = 10.0) -> None:
        """Return once ``predicate()`` holds; it is re-checked whenever a stream makes progress
        (index writes done, a restart, a reconnection).  TimeoutError after ``timeout``."""
        async with asyncio.timeout(timeout):
            while not predicate():
                await self._changed.wait()

    async def wait_applied(self, replica: str, seq: int, timeout: float = 10.0) -> None:
        """Until the batch ``seq`` of ``replica``'s current publisher is in the index."""

        def done() -> bool:
            st = self.status(replica)
            return st is not None and st.last_seq is not None and st.last_seq >= seq

        await self.wait_until(done, timeout)

    async def wait_synced(self, replica: str, timeout: float = 10.0) -> None:
        """Until ``replica``'s history is applied and its first connection has settled (nothing
        published before the subscription took effect is missing)."""

        def done() -> bool:
            st = self.status(replica)
            return st is not None and st.synced

        await self.wait_until(done, timeout)

    # -- internals ------------------------------------------------------------------------
    def _heard(self, stream: ReplicaStream, state: HeardState) -> None:
        if self._on_state is not None and self._streams.get(stream.name) is stream:  # not a stopped one's
            self._on_state(stream.name, state)

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def _spawn(self, name: str) -> None:
        stream = self._streams[name]
        task = asyncio.get_running_loop().create_task(stream.run(), name=f"kv-events-{name}")
        self._tasks[name] = task

    def _cancel(self, name: str) -> asyncio.Task[None] | None:
        """Synchronous, so that fleet events keep their order: the stream is gone at once, its
        task finishes (closing its sockets) on its own."""
        self._streams.pop(name, None)
        task = self._tasks.pop(name, None)
        if task is None:
            return None
        task.cancel()
        # ...and again until it ends: a cancellation can be lost during a Redis call (router/aio.py)
        reaper = asyncio.get_running_loop().create_task(cancel_and_wait([task]))
        self._stopping.add(reaper)
        reaper.add_done_callback(self._stopping.discard)
        self._notify()
        return reaper


__all__ = ["KVEventSubscriber", "StreamStatus", "base_model", "reachable_endpoint"]
