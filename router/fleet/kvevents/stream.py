"""One replica's KV-event stream: the socket loop that follows a publisher (docs/design.md §4).

Each live batch is applied as ``sequence.py`` classifies it (§4.2).  A gap is filled from the
replay endpoint, asked from one batch before it so the first reply proves the same process, or
else ``drop_confirmed`` and relearn (§4.3); a restart clears the replica, forgets its hash map and
replays the new process from 0 (§4.4); first contact drops confirmed entries and replays what the
replica buffers (§4.3).  ``settle_s`` after each connection, and ``idle_check_s`` after the last
live batch, the stream asks the replay endpoint for anything newer (ZMQ's slow joiner, a batch
dropped on a full queue: §4.5); these count as ``checks``, not replays, unless they find something.
A reconnection of the SUB socket is checked like a gap: the publisher may be a new process whose
seq happens to continue ours.  An endpoint nobody publishes on is called silent by
``liveness.py`` (§4.8) while ZMQ keeps retrying; a replay endpoint that does not answer is logged
once until it does.  When the index fails, writes stop until it answers; then the stream resyncs
(``drop_confirmed`` and a replay from 0, §7.4), since the writes in between are lost.

The pieces: ``sequence.py`` tells what a batch is (apply, applied, gap, changed), ``replay.py``
fetches a replica's buffered batches, ``index_writer.py`` coalesces and writes what the batches
say; this module is the socket loop that drives them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import xxhash
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvroute.router.index.client import IndexClient

from kvroute.router.fleet.kvevents.index_writer import IndexWriter
from kvroute.router.fleet.kvevents.liveness import EventsLiveness, HeardState
from kvroute.router.fleet.kvevents.metrics import KVEventMetrics
from kvroute.router.fleet.kvevents.replay import ReplayError, replay_batches
from kvroute.router.fleet.kvevents.sequence import BatchSequence
from kvroute.router.fleet.kvevents.translate import ChainTranslator
from kvroute.router.fleet.kvevents.wire import AllBlocksCleared, BatchDecoder, BlockRemoved, BlockStored, WireError, parse_live

log = logging.getLogger("kvroute.kvevents")

RCV_HWM = 100_000  # live batches ZMQ may queue while a replay or a slow index holds us up
INDEX_RETRY_S = 1.0  # also the longest poll: a resync the index client asks for waits at most this
CRASH_BACKOFF_S = 1.0
RECONNECT_IVL_MAX_MS = 5000  # ZMQ doubles its 100 ms reconnect interval up to this while nobody listens
_digest = xxhash.xxh3_64_intdigest

ReplayOutcome = Literal["ok", "lost", "restarted", "failed"]


@dataclass
class StreamStatus:
    """Plain data for tests, the admin API and logs."""

    replica: str
    endpoint: str
    replay_endpoint: str | None
    model: str
    last_seq: int | None  # last batch whose index writes are done (this publisher's numbering)
    batches_applied: int
    restarts: int
    gaps: int
    replays: int
    checks: int  # settle and idle checks against the replay endpoint (replays only if they found batches)
    reconnects: int
    synced: bool  # history replayed and the first connection settled (always True without a replay endpoint)
    heard: HeardState  # pending, following (a batch or replay answer came), silent (nothing in the bound)
    connected: bool
    index_ok: bool
    mapped_blocks: int  # engine hashes the translator knows
    last_lag_s: float | None


class ReplicaStream:
    def __init__(
        self,
        *,
        name: str,
        endpoint: str,
        replay_endpoint: str | None,
        model: str,
        capacity_blocks: int,
        bind: bool,
        index: IndexClient,
        block_size_for: Callable[[str], int],
        metrics: KVEventMetrics,
        context: zmq.asyncio.Context,
        on_progress: Callable[[], None],
        replay_timeout_s: float,
        max_chunk: int,
        settle_s: float,
        idle_check_s: float,
        topic: str = "",
        silent_after_s: float = 10.0,
        on_heard: Callable[[HeardState], None] = lambda state: None,
    ) -> None:
        self.name = name
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.model = model
        self.bind = bind
        self.writer = IndexWriter(name, index, metrics)
        self._block_size_for = block_size_for
        self._metrics = metrics
        self._series = metrics.replica_series(name)
        self._ctx = context
        self._on_progress = on_progress
        self._replay_timeout_s = replay_timeout_s
        self._max_chunk = max_chunk
        self._settle_s = settle_s
        self._idle_check_s = idle_check_s
        self._topic = topic.encode()
        self.liveness = EventsLiveness(name, endpoint, silent_after_s, on_heard)
        self._replay_failing = False  # its last replay failed (logged once until one succeeds)
        self.translator = ChainTranslator(model, capacity_blocks)
        self._decoder = BatchDecoder()
        self._sub: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._poller: zmq.asyncio.Poller | None = None
        # sequence bookkeeping
        self.sequence = BatchSequence()
        # status
        self.last_seq: int | None = None
        self.restarts = self.gaps = self.replays = self.reconnects = 0
        self.synced = False  # the history is replayed and the first connection's catch-up done
        self._contacted = False  # the first-contact replay is done
        # when to ask the replay endpoint for anything after the last batch: ``settle_s`` after a
        # connection (``_settling``: live batches do not postpone it), or ``idle_check_s`` after
        # the last live batch
        self._check_at: float | None = None
        self._settling = False
        self.checks = 0  # such checks asked
        self.connected = False
        self._was_disconnected = False

    def status(self) -> StreamStatus:
        return StreamStatus(
            replica=self.name, endpoint=self.endpoint, replay_endpoint=self.replay_endpoint, model=self.model,
            last_seq=self.last_seq, batches_applied=self.writer.batches_applied, restarts=self.restarts, gaps=self.gaps,
            replays=self.replays, checks=self.checks, reconnects=self.reconnects, synced=self.synced,
            heard=self.liveness.state, connected=self.connected,
            index_ok=self.writer.ok, mapped_blocks=len(self.translator), last_lag_s=self.writer.last_lag_s,
        )

    # -- lifecycle ------------------------------------------------------------------------
    async def run(self) -> None:
        """Until cancelled.  A bug in one pass is logged and the stream starts over from scratch."""
        while True:
            try:
                await self._run_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a bug must not leave the replica unwatched for good
                log.exception("KV-event stream of %s failed; starting it over", self.name)
                self._close()
                self._reset_sequence(clear_map=True)
                self.synced = self._contacted = False
                await asyncio.sleep(CRASH_BACKOFF_S)

    async def _run_once(self) -> None:
        try:
            self._open()
            self._check_at, self._settling = None, False
            await self._first_contact()
            assert self._poller is not None
            while True:
                ready = dict(await self._poller.poll(self._poll_timeout_ms()))
                if self._monitor in ready:
                    await self._on_monitor()
                if self._sub in ready:
                    await self._on_live()
                if not self.writer.ok:
                    await self._resync_after_index_failure()
                if self._check_at is not None and time.monotonic() >= self._check_at:
                    await self._check()
                self.liveness.check()
        finally:
            self._close()

    def _poll_timeout_ms(self) -> int:
        """Until the next timed duty (a check), at most INDEX_RETRY_S (an index retry, a resync)."""
        wait = INDEX_RETRY_S
        if self._check_at is not None:
            wait = min(wait, max(0.0, self._check_at - time.monotonic()))
        return int(wait * 1000) + 1

    def request_resync(self) -> None:
        """The index lost what this stream wrote (Redis restarted empty): rebuild it from history
        at the next turn of the loop, as after an index failure."""
        self.writer.ok = False

    def _open(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, RCV_HWM)
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic)  # a prefix: b"" (vLLM's default topic) takes every topic
        kinds = zmq.EVENT_DISCONNECTED | (zmq.EVENT_ACCEPTED if self.bind else zmq.EVENT_CONNECTED)
        monitor = sub.get_monitor_socket(kinds)
        try:
            if self.bind:
                sub.bind(self.endpoint)
            else:
                sub.connect(self.endpoint)
        except zmq.ZMQError:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)
            raise
        poller = zmq.asyncio.Poller()
        poller.register(monitor, zmq.POLLIN)
        poller.register(sub, zmq.POLLIN)
        self._sub, self._monitor, self._poller = sub, monitor, poller

    def _close(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._sub.disable_monitor()
            self._sub.close(linger=0)
            self._sub = None
        if self._monitor is not None:
            self._monitor.close(linger=0)
            self._monitor = None
        self._poller = None
        self.connected = False

    # -- socket events --------------------------------------------------------------------
    async def _on_monitor(self) -> None:
        assert self._monitor is not None
        while True:
            try:
                frames = await self._monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            event = parse_monitor_message(frames)["event"]
            if event == zmq.EVENT_DISCONNECTED:
                self.connected = False
                self._was_disconnected = True
                self.liveness.lost_contact()
                self._on_progress()
            elif event in (zmq.EVENT_CONNECTED, zmq.EVENT_ACCEPTED):
                self.connected = True
                if self._was_disconnected:
                    self._was_disconnected = False
                    self.reconnects += 1
                    await self._after_reconnect()
                elif not self._contacted:
                    await self._first_contact()  # the replica was not reachable when we first tried
                if self.replay_endpoint:
                    self._check_at, self._settling = time.monotonic() + self._settle_s, True
                self._on_progress()
            await self._flush()

    async def _on_live(self) -> None:
        """Everything the SUB socket holds now (up to ``max_chunk``), then one flush."""
        assert self._sub is not None
        for _ in range(self._max_chunk):
            try:
                frames = await self._sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                seq, payload = parse_live(frames)
            except WireError as exc:
                log.warning("replica %s: not a KV-event message: %s", self.name, exc)
                self._metrics.skip("bad_frame")
                continue
            self.liveness.heard()
            await self._live(seq, payload)
        await self._flush()
        if self.replay_endpoint and not self._settling:
            self._check_at = time.monotonic() + self._idle_check_s

    async def _live(self, seq: int, payload: bytes) -> None:
        sequence = self.sequence
        digest = _digest(payload)
        if sequence.went_back(seq):
            await self._restart(f"live seq {seq} after {sequence.last_live}")
        sequence.last_live = seq
        verdict = sequence.classify(seq, digest)
        if verdict == "changed":
            await self._restart(f"seq {seq} arrived with other contents than the batch applied under it")
            verdict = sequence.classify(seq, digest)
        if verdict == "gap":
            await self._gap(sequence.next, seq)  # type: ignore[arg-type]
            verdict = sequence.classify(seq, digest)
        if verdict == "apply":  # else a replay (a gap's, or an earlier one) applied it already
            self._apply(seq, payload, digest, live=True)

    # -- sequence handling ----------------------------------------------------------------
    async def _first_contact(self) -> None:
        """Rebuild what the index knows of this replica from the history it buffers."""
        if not self.replay_endpoint:
            self.synced = self._contacted = True
            return
        self.sequence.forget_position()  # apply the whole history, whatever was applied before
        outcome = await self._replay(0, verify=None, drop_first=True)
        if outcome == "failed":
            return  # following live events only; a reconnection tries again
        self._contacted = True
        if self.sequence.next is None:
            self.sequence.next = 0  # nothing published yet: the first batch will be seq 0
        self._on_progress()

    async def _gap(self, expected: int, seq: int) -> None:
        self.gaps += 1
        self._series.gaps.inc()
        log.info("replica %s: KV-event gap, expected seq %d, got %d", self.name, expected, seq)
        if not self.replay_endpoint:
            self._lost()
            return
        outcome = await self._replay_from(expected)
        if outcome == "restarted":
            await self._restart("the replay shows another process")
        elif outcome == "failed" or (self.sequence.next is not None and self.sequence.next < seq):
            self._lost()  # what is still missing cannot be had

    async def _after_reconnect(self) -> None:
        """The publisher went away and came back: a network blip, or a new process."""
        log.info("replica %s: KV-event socket reconnected", self.name)
        if not self.replay_endpoint:
            self._lost()  # whatever it published meanwhile is gone; a new process shows by its seq
            return
        if self.sequence.next is None or not self._contacted:
            await self._first_contact()
            return
        outcome = await self._replay_from(self.sequence.next)
        if outcome == "restarted":
            await self._restart("the replay after a reconnection shows another process")
        elif outcome == "failed":
            self._lost()

    async def _check(self) -> None:
        """Replay whatever came after the last batch applied (nothing, usually): what a new
        subscription missed (the stream is synced once the first such check is done), or what a
        quiet stream may have lost last.  Counted as a replay only if it brings something."""
        settled, self._check_at, self._settling = self._settling, None, False
        start = self.sequence.next
        if self._contacted and start is not None:
            self.checks += 1
            outcome = await self._replay_from(start, counted=False)
            if outcome == "restarted":
                await self._restart("the check's replay shows another process")
            elif outcome == "lost" or self.sequence.next != start:
                self._count_replay()
                log.info("replica %s: KV-event batches the live stream had missed came by replay", self.name)
        if self._contacted and settled:
            self.synced = True
        self._on_progress()

    async def _replay_from(self, expected: int, *, counted: bool = True) -> ReplayOutcome:
        """Replay from ``expected``, starting one earlier to prove it is the same process."""
        previous = self.sequence.digest(expected - 1)
        if previous is not None:
            return await self._replay(expected - 1, verify=(expected - 1, previous), drop_first=False, counted=counted)
        return await self._replay(expected, verify=None, drop_first=False, counted=counted)

    async def _restart(self, reason: str) -> None:
        log.warning("replica %s restarted (%s): clearing its index entries", self.name, reason)
        self.restarts += 1
        self._series.restarts.inc()
        self.writer.add("clear", [])
        self._reset_sequence(clear_map=True)
        if self.replay_endpoint:
            await self._replay(0, verify=None, drop_first=False)
        await self._flush()
        self._on_progress()

    def _lost(self) -> None:
        """Events are gone for good: forget what events confirmed, keep following."""
        log.warning("replica %s: KV events lost; dropping its confirmed entries", self.name)
        self.writer.add("drop", [])
        self.sequence.forget_position()

    def _reset_sequence(self, *, clear_map: bool) -> None:
        """Forget the publisher's numbering (a new process counts from 0 again)."""
        self.sequence.reset()
        self.last_seq = None
        if clear_map:
            self.translator.clear()

    # -- replay ---------------------------------------------------------------------------
    async def _replay(
        self, start: int, *, verify: tuple[int, int] | None, drop_first: bool, counted: bool = True
    ) -> ReplayOutcome:
        """Ask the replay endpoint for every batch from ``start`` and apply what is new.

        ``verify``: (seq, digest) the first reply must match, else the publisher is another
        process ("restarted", nothing applied).  "lost": the buffer no longer reaches back to
        ``start`` (confirmed entries dropped, the rest applied).  ``drop_first``: drop confirmed
        entries before applying (first contact).  ``counted``: in the replay counters (a check
        counts itself, only when it brought something).
        """
        assert self.replay_endpoint is not None
        await self._flush()
        if counted:
            self._count_replay()
        outcome: ReplayOutcome = "ok"
        first = True
        since_flush = 0
        try:
            batches = replay_batches(self._ctx, self.replay_endpoint, start, self._replay_timeout_s)
            async with contextlib.aclosing(batches):
                async for seq, payload in batches:
                    if first:
                        first = False
                        self._replay_answered()
                        if verify is not None and seq == verify[0] and _digest(payload) != verify[1]:
                            return "restarted"  # something else under our last seq
                        if seq > start:
                            outcome = "lost"
                        if drop_first or outcome == "lost":
                            self.writer.add("drop", [])
                    if self.sequence.next is not None and seq < self.sequence.next:
                        continue  # applied already (the verified batch, or an overlap)
                    self._apply(seq, payload, _digest(payload), live=False)
                    since_flush += 1
                    if since_flush >= self._max_chunk:
                        await self._flush()
                        await asyncio.sleep(0)  # a long history must not starve the router's requests
                        since_flush = 0
            if first:  # nothing buffered from ``start`` on
                self._replay_answered()
                if verify is not None:
                    return "restarted"  # not even our last seq: another process
                if drop_first:
                    self.writer.add("drop", [])
        except ReplayError as exc:
            # logged once until the endpoint answers: one that never does (vLLM's default has none)
            # must not fill the log at every reconnection
            log.log(logging.DEBUG if self._replay_failing else logging.WARNING,
                    "replica %s: replay from seq %d at %s failed (%r); following live events only until it answers",
                    self.name, start, self.replay_endpoint, exc)
            self._replay_failing = True
            outcome = "failed"
        await self._flush()
        return outcome

    def _replay_answered(self) -> None:
        if self._replay_failing:
            log.info("replica %s: its replay endpoint %s answers", self.name, self.replay_endpoint)
        self._replay_failing = False
        self.liveness.heard()

    def _count_replay(self) -> None:
        self.replays += 1
        self._series.replays.inc()

    # -- applying -------------------------------------------------------------------------
    def _apply(self, seq: int, payload: bytes, digest: int, *, live: bool) -> None:
        """Translate one batch into pending index writes; ``_flush`` writes them."""
        self.sequence.applied(seq, digest)
        writer = self.writer
        try:
            batch = self._decoder.decode(payload)
        except WireError as exc:
            log.warning("replica %s: undecodable KV-event batch %d: %s", self.name, seq, exc)
            self._metrics.skip("bad_frame")
            writer.batch(None)
            return
        skip = self._metrics.skip
        if batch.undecodable:
            skip("undecodable", batch.undecodable)
        block_size = self._block_size_for(self.model)
        translator = self.translator
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                hashes = translator.stored(ev, block_size, skip)
                if hashes:
                    writer.add("confirm", hashes)
                writer.event("BlockStored")
            elif isinstance(ev, BlockRemoved):
                hashes = translator.removed(ev, skip)
                if hashes:
                    writer.add("remove", hashes)
                writer.event("BlockRemoved")
            elif isinstance(ev, AllBlocksCleared):
                translator.clear()
                writer.add("clear", [])
                writer.event("AllBlocksCleared")
        writer.batch(batch.ts if live else None)

    async def _flush(self) -> None:
        written = await self.writer.flush()
        if written is None:
            return
        if written and self.sequence.next is not None:
            self.last_seq = self.sequence.next - 1
        self._on_progress()

    async def _resync_after_index_failure(self) -> None:
        """The writes since the failure are lost: once the index answers, rebuild from history.

        The hash map stays: it followed every event meanwhile, so children of blocks stored
        before the replay window still find their parents.
        """
        if not await self.writer.reopen():
            return  # still down; the poll timeout brings us back
        log.info("replica %s: index reachable again, resyncing", self.name)
        if self.replay_endpoint:
            self.sequence.forget_position()
            await self._replay(0, verify=None, drop_first=False)
        self._on_progress()
