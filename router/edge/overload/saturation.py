"""The router's own saturation, measured: how late the event loop runs, how many tokenizer jobs
wait for a thread, how many connections wait in the kernel to be accepted, and from those an
in-flight limit that follows them.

A router short of CPU does not refuse work by itself: every request it accepts makes each loop
turn longer, and all of them slower.  Every ``TICK_S`` a callback measures how late it ran (the
loop's lag, smoothed over a couple of ticks).  Above ``saturated_loop_lag_s``, or with more than
``BACKLOG_PER_THREAD`` tokenizer jobs per thread waiting (tokenizing is the CPU a new prompt costs),
or more than ``ACCEPT_BACKLOG`` connections completed by the kernel and not yet accepted on two
ticks in a row (:func:`accept_backlog`), the router is saturated and the limit comes down to 90% of what is in flight (at least
``MIN_LIMIT``); otherwise it climbs back by 10% a tick towards ``max_in_flight`` (a limit left low
on a shared core would throttle a router that could serve more: the floor and the quick climb keep
that short).  Requests over the limit queue (admission.py) instead of lengthening the loop: queueing
holds a request for free, serving it costs everyone (design.md §7.6).  Every tick also measures the
rate requests finish at while some wait, the queue's drain rate: over the last ``DRAIN_WINDOW_S`` (or
the budget, if longer), and only once ``MIN_DRAIN_SAMPLES`` requests finished in it (a rate of 0 from
a queue behind one long request says nothing certain).

The accept backlog is the signal the loop's lag misses: a router short of CPU still turns its loop
every few tens of milliseconds (each turn accepts what the kernel has queued, reads what is ready,
and the lag stays under its mark) while its work grows faster than it does it; what it has not
reached waits in the kernel, first in the listening socket's accept queue.  Measured (docs/
experiments.md, 2026-12-04, the accept backlog): at 2x its capacity a one-worker router lagged
under 50 ms, served nearly all it was offered, and every request waited 3-8 s in that queue (and
past its 4,096 the kernel dropped SYNs, retransmitted 1, 3, 7 s later).  Linux reports the queue's
length for a listening socket in ``TCP_INFO`` (``tcpi_unacked``; ``tcpi_sacked`` is its bound).
Past the accept queue a request may still wait in its socket's buffer; ``TCP_INFO`` of the
connection tells how long ago its last bytes came, and so how long they waited before the router
read them (:func:`kernel_wait_s`): admission refuses a request that waited over
``--stale-request-s`` (``STALE_S``) there (serving it would be late; answering it costs little) and
counts the router saturated for two ticks, as CoDel judges a queue by the time spent in it.

The same two measures, the accept queue and the time requests waited in the kernel (reported
for every request: :meth:`Saturation.saw_wait`), say when the router is short of CPU for the
fair shares (:meth:`Saturation.short_of_cpu`, shares.py), which every tick also gets the
throughput (requests finished per second, smoothed) and whether the kernel's queue drains.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import time
from collections import deque
from collections.abc import Callable

from kvroute.router.edge.overload.shares import TenantShares

log = logging.getLogger("kvroute.router")

TICK_S = 0.05
MIN_LIMIT = 32  # a floor: a lag from elsewhere (a busy shared core) never throttles a lightly loaded router
LAG_SMOOTHING = 0.5  # weight of the latest tick: one late tick (the process descheduled once) is not saturation
BACKLOG_PER_THREAD = 4
DECREASE = 0.9
INCREASE = 0.1
DRAIN_WINDOW_S = 1.0
MIN_DRAIN_SAMPLES = 8
# Linux's struct tcp_info: eight u8 fields, then u32s: tcpi_unacked at byte 24 (a listening
# socket's accept queue length), tcpi_last_data_recv at 52 (ms since data last arrived)
_UNACKED, _LAST_DATA_RECV = 24, 52
ACCEPT_BACKLOG = 64  # connections waiting to be accepted: more, on two ticks in a row, is saturation
ACCEPT_BACKLOG_SHARING = 16  # ... and more, on one tick, while fair shares are on (shares.py)
STANDING_WAIT_S = 0.05  # a tick whose every request waited this long in the kernel: a standing queue
DRAINING = 0.95  # the kernel's queue is draining when it is this much of the last tick's, or less
THROUGHPUT_SMOOTHING = 0.2  # weight of a tick's finished requests in the throughput (~0.25 s)
STALE_S = 0.25  # --stale-request-s to use with --no-queue-when-saturated: a request read this long after its last byte reached the kernel is stale


def kernel_wait_s(sock: socket.socket | None, read_at: float, ready_at: float = 0.0) -> float:
    """How long the last bytes of this connection waited in the kernel for a router that would have
    read them: from when the kernel received them (``TCP_INFO``'s ``tcpi_last_data_recv``, ms ago)
    or, if later, ``ready_at`` (the end of the connection's previous answer: aiohttp reads no
    further request before it, so a pipelined request waits for the one before it, not for a busy
    router) to ``read_at`` (both ``time.monotonic()``); 0 where it cannot be read.  For a request
    whose bytes came at once, the time it waited in the accept queue and its socket's buffer."""
    if sock is None or read_at <= 0:
        return 0.0
    try:
        since_kernel = struct.unpack_from("I", sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 64), _LAST_DATA_RECV)[0] / 1000
    except (OSError, AttributeError, struct.error):
        return 0.0
    return read_at - max(time.monotonic() - since_kernel, ready_at)


def accept_backlog(sockets: list[socket.socket]) -> int:
    """Connections the kernel completed and queued on these listening sockets, not yet accepted
    (``TCP_INFO``'s ``tcpi_unacked`` of a listening socket); 0 where it cannot be read."""
    total = 0
    for sock in sockets:
        try:
            total += struct.unpack_from("I", sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 32), _UNACKED)[0]
        except (OSError, AttributeError, struct.error):  # not Linux, not TCP (a Unix socket), closed
            pass
    return total


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
        accept_backlog: Callable[[], int] = lambda: 0,
        backlog_saturates: bool = False,
        shares: TenantShares | None = None,
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
        self.accept_backlog = accept_backlog  # set by Admission.start: the listening sockets
        self.backlog_saturates = backlog_saturates  # the accept queue lowers the limit (else: shares only)
        self.shares = shares  # fair shares while short of CPU (shares.py), ticked here
        self.throughput: float | None = None  # requests finished per second, smoothed; None: not yet
        self._least_wait: float | None = None  # the least kernel wait of a request read this tick
        self._standing = 0  # ticks in a row on which every request read had waited STANDING_WAIT_S
        self._last_least_wait: float | None = None
        self.draining = False  # short of CPU, and the kernel's queue shrank on the last tick
        self.backlog = 0  # connections waiting to be accepted, the last tick
        self._backlogged = 0  # ticks in a row with more than ACCEPT_BACKLOG
        self.stale_ticks = 0  # ticks left during which a stale request seen counts as saturation
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
        stale = self.stale_ticks > 0
        backlogged = self.backlog_saturates and self._backlogged >= 2
        return lagging or stale or backlogged or self._pool_backlog() > self._max_backlog

    def short_of_cpu(self) -> bool:
        """Requests wait in the kernel to be read (a standing wait, or a long accept queue): the
        signal of the fair shares (shares.py).  Not the loop's lag nor the tokenizer pool: a closed
        loop of clients saturates both at the router's capacity, and refusing it would gain nothing
        (each client sends its next request at once); a queue in the kernel grows only when more
        comes than the router reads."""
        if self.shares is not None and self.shares.active and self.backlog > ACCEPT_BACKLOG_SHARING:
            return True  # with shares on, any queue of connections is the next burst: react on its first tick
        return self._standing >= 2 or self._backlogged >= 2

    def saw_wait(self, waited_s: float) -> None:
        """A request was read ``waited_s`` after its last bytes reached the kernel (kernel_wait_s)."""
        if self._least_wait is None or waited_s < self._least_wait:
            self._least_wait = waited_s

    def saw_stale(self) -> None:
        """A request reached admission stale (``STALE_S`` after its last byte): saturated for 2 ticks."""
        self.stale_ticks = 2

    def _tick(self) -> None:
        now = time.perf_counter()
        elapsed = now - self._last
        self.lag_s = LAG_SMOOTHING * max(0.0, elapsed - TICK_S) + (1 - LAG_SMOOTHING) * self.lag_s
        self._last = now
        backlog_then, wait_then, least_wait = self.backlog, self._last_least_wait, self._least_wait
        self.backlog = self.accept_backlog()
        self._backlogged = self._backlogged + 1 if self.backlog > ACCEPT_BACKLOG else 0
        # a tick on which nothing was read ends a standing wait (a router that reads nothing because it
        # is stuck lags instead; one that has nothing to read is not short)
        self._standing = self._standing + 1 if least_wait is not None and least_wait > STANDING_WAIT_S else 0
        self._last_least_wait, self._least_wait = least_wait, None
        # the kernel's queue shrinks (each signal that is on, by DRAINING a tick): the router reads
        # faster than requests come, so the shares' rate holds instead of coming down further
        shrinking = []
        if self._backlogged >= 2:
            shrinking.append(self.backlog <= DRAINING * backlog_then)
        if self._standing >= 2 and least_wait is not None and wait_then is not None:
            shrinking.append(least_wait <= DRAINING * wait_then)
        self.draining = bool(shrinking) and all(shrinking)
        if self.shares is not None and self.shares.active and log.isEnabledFor(logging.DEBUG):
            log.debug("saturation: least kernel wait %s, standing %d, accept backlog %d, draining %s, lag %.3f",
                      least_wait, self._standing, self.backlog, self.draining, self.lag_s)
        saturated = self.saturated()
        self.stale_ticks = max(0, self.stale_ticks - 1)
        finished, self._finished_then = self.finished - self._finished_then, self.finished
        rate = finished / elapsed if elapsed > 0 else 0.0
        self.throughput = rate if self.throughput is None else (
            THROUGHPUT_SMOOTHING * rate + (1 - THROUGHPUT_SMOOTHING) * self.throughput)
        if self.shares is not None:
            self.shares.tick(self.short_of_cpu(), self.throughput, elapsed, time.monotonic(), draining=self.draining)
        if self._queued():  # the drain rate is only worth knowing while requests wait
            self._drained.append((now, elapsed, finished))
        while self._drained and self._drained[0][0] < now - self._drain_window_s:
            self._drained.popleft()
        done = sum(n for _, _, n in self._drained)
        span = sum(dt for _, dt, _ in self._drained)
        self.drain_rate = done / span if done >= MIN_DRAIN_SAMPLES and span > 0 else None
        if saturated:
            self.limit = max(float(MIN_LIMIT), min(self.limit, self._in_flight()) * DECREASE)
        else:
            self.limit = min(float(self.max_in_flight), self.limit + max(2.0, self.limit * INCREASE))
        self._handle = asyncio.get_running_loop().call_later(TICK_S, self._tick)
        self._on_tick()
