"""A KV-event stream's index writes: coalesced in order, written in one go, counted once written.

Batches read together (up to the stream's ``max_chunk``) become one ``confirm`` / ``remove`` call
per run of the same operation, so a Redis index pays a round trip per run, not per event.  When
a write fails, writing stops (``ok`` False) until the stream has resynced: the writes in between
are lost, and only a replay of the replica's history can restore them.
"""

from __future__ import annotations

import logging
import time
from typing import Literal

from kvroute.router.index.client import IndexClient

from kvroute.router.fleet.kvevents.metrics import KVEventMetrics

log = logging.getLogger("kvroute.kvevents")

OpKind = Literal["confirm", "remove", "clear", "drop"]
EventKind = Literal["BlockStored", "BlockRemoved", "AllBlocksCleared"]


class IndexWriter:
    def __init__(self, replica: str, index: IndexClient, metrics: KVEventMetrics):
        self.replica = replica
        self.index = index
        self._metrics = metrics
        self._series = metrics.replica_series(replica)
        self._ops: list[tuple[OpKind, list[int]]] = []
        # what the pending ops carry, reported once they are written
        self._events: dict[EventKind, int] = {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0}
        self._batches = 0
        self._lag_ts: list[float] = []
        self.ok = True  # False from a failed write until resynced
        self.batches_applied = 0
        self.last_lag_s: float | None = None

    def add(self, kind: OpKind, hashes: list[int]) -> None:
        ops = self._ops
        if kind == "clear":
            ops.clear()  # a clear makes every earlier write of this replica moot
        elif ops and ops[-1][0] == kind and kind in ("confirm", "remove"):
            ops[-1][1].extend(hashes)
            return
        ops.append((kind, hashes))

    def batch(self, live_ts: float | None) -> None:
        """One more batch behind the pending writes (its publish time, when read live)."""
        self._batches += 1
        if live_ts is not None:
            self._lag_ts.append(live_ts)

    def event(self, kind: EventKind) -> None:
        self._events[kind] += 1

    async def flush(self) -> bool | None:
        """Write what is pending: True once written, False if a write failed (``ok`` turns
        False and what was pending is dropped), None when there was nothing to write."""
        ops, self._ops = self._ops, []
        batches, self._batches = self._batches, 0
        lag_ts, self._lag_ts = self._lag_ts, []
        events = self._events
        self._events = dict.fromkeys(events, 0)  # type: ignore[assignment]
        if not ops and not batches:
            return None
        if not self.ok:
            self._metrics.skip("index_unavailable", batches)  # the resync replays what it can
            return False
        if not await self._write(ops):  # counted by the index client
            log.warning("replica %s: index write failed; resyncing once it answers", self.replica)
            self.ok = False
            self._metrics.skip("index_unavailable", batches)
            return False
        now = time.time()
        for ts in lag_ts:
            self._series.lag.observe(max(0.0, now - ts))
        if lag_ts:
            self.last_lag_s = now - lag_ts[-1]
        for kind, n in events.items():
            if n:
                self._series.applied[kind].inc(n)
        self.batches_applied += batches
        return True

    async def _write(self, ops: list[tuple[OpKind, list[int]]]) -> bool:
        index, name = self.index, self.replica
        for kind, hashes in ops:
            if kind == "confirm":
                ok = await index.confirm(name, hashes)
            elif kind == "remove":
                ok = await index.remove(name, hashes)
            elif kind == "clear":
                ok = await index.clear_replica(name)
            else:
                ok = await index.drop_confirmed(name)
            if not ok:
                return False
        return True

    async def reopen(self) -> bool:
        """After a failure: once the index answers, forget what events confirmed (the stream
        then replays the history) and write again.  False while it still does not answer."""
        if not await self.index.drop_confirmed(self.replica):
            return False
        self.ok = True
        self._ops.clear()
        return True
