"""The router's own saturation, measured: how late the event loop runs, how many tokenizer jobs
wait for a thread, and from those an in-flight limit that follows them.

A router short of CPU does not refuse work by itself: every request it accepts makes each loop
turn longer, and all of them slower.  Every ``TICK_S`` a callback measures how late it ran (the
loop's lag, smoothed over a couple of ticks).  Above ``saturated_loop_lag_s``, or with more than
``BACKLOG_PER_THREAD`` tokenizer jobs per thread waiting (tokenizing is the CPU a new prompt costs),
the router is saturated and the limit comes down to 90% of what is in flight (at least
``MIN_LIMIT``); otherwise it climbs back by 10% a tick towards ``max_in_flight`` (a limit left low
on a shared core would throttle a router that could serve more: the floor and the quick climb keep
that short).  Requests over the limit queue (admission.py) instead of lengthening the loop: queueing
holds a request for free, serving it costs everyone (design.md §7.6).  Every tick also measures the
rate requests finish at while some wait, the queue's drain rate: over the last ``DRAIN_WINDOW_S`` (or
the budget, if longer), and only once ``MIN_DRAIN_SAMPLES`` requests finished in it (a rate of 0 from
a queue behind one long request says nothing certain).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

TICK_S = 0.05
MIN_LIMIT = 32  # a floor: a lag from elsewhere (a busy shared core) never throttles a lightly loaded router
LAG_SMOOTHING = 0.5  # weight of the latest tick: one late tick (the process descheduled once) is not saturation
BACKLOG_PER_THREAD = 4
DECREASE = 0.9
INCREASE = 0.1
DRAIN_WINDOW_S = 1.0
MIN_DRAIN_SAMPLES = 8


class Saturation:
    def __init__(
        self,
        *,
        max_in_flight: int,
        max_loop_lag_s: float,
        in_flight: Callable[[], int],
        queued: Callable[[], int],
        pool_backlog: Callable[[], int],
        pool_threads: int,
        on_tick: Callable[[], None],
        drain_window_s: float = DRAIN_WINDOW_S,
    ):
        self.max_in_flight = max_in_flight
        self.max_loop_lag_s = max_loop_lag_s
        self.limit = float(max_in_flight)
        self.lag_s = 0.0
        self.drain_rate: float | None = None  # requests finished per second while some waited; None: not known
        self._drain_window_s = max(DRAIN_WINDOW_S, drain_window_s)
        self._drained: deque[tuple[float, float, int]] = deque()  # (tick time, its length, finished) while queued
        self.finished = 0  # requests finished, counted by the caller
        self._in_flight, self._queued = in_flight, queued
        self._pool_backlog, self._max_backlog = pool_backlog, BACKLOG_PER_THREAD * max(1, pool_threads)
        self._on_tick = on_tick
        self._handle: asyncio.TimerHandle | None = None
        self._last = 0.0
        self._finished_then = 0

    def start(self) -> None:
        self._last = time.perf_counter()
        self._handle = asyncio.get_running_loop().call_later(TICK_S, self._tick)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def saturated(self) -> bool:
        lagging = self.max_loop_lag_s > 0 and self.lag_s > self.max_loop_lag_s
        return lagging or self._pool_backlog() > self._max_backlog

    def _tick(self) -> None:
        now = time.perf_counter()
        elapsed = now - self._last
        self.lag_s = LAG_SMOOTHING * max(0.0, elapsed - TICK_S) + (1 - LAG_SMOOTHING) * self.lag_s
        self._last = now
        finished, self._finished_then = self.finished - self._finished_then, self.finished
        if self._queued():  # the drain rate is only worth knowing while requests wait
            self._drained.append((now, elapsed, finished))
        while self._drained and self._drained[0][0] < now - self._drain_window_s:
            self._drained.popleft()
        done = sum(n for _, _, n in self._drained)
        span = sum(dt for _, dt, _ in self._drained)
        self.drain_rate = done / span if done >= MIN_DRAIN_SAMPLES and span > 0 else None
        if self.saturated():
            self.limit = max(float(MIN_LIMIT), min(self.limit, self._in_flight()) * DECREASE)
        else:
            self.limit = min(float(self.max_in_flight), self.limit + max(2.0, self.limit * INCREASE))
        self._handle = asyncio.get_running_loop().call_later(TICK_S, self._tick)
        self._on_tick()
