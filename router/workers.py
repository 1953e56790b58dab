"""``kvroute router --workers N``: N router processes on one port, under a small supervisor (docs/design.md §11).

Each worker is a whole router (router/main.py's ``serve_worker``, which this module is handed)
listening on the same port with SO_REUSEPORT; the kernel spreads new connections over them (a
keep-alive connection stays with one worker).  The supervisor, this module:

- gives the workers a fresh ``PROMETHEUS_MULTIPROC_DIR`` (router/worker_metrics.py) and deletes a
  dead worker's live gauges;
- starts them with multiprocessing's spawn and prints one ``listening on`` line once all listen; a
  worker that exits before it listened fails the start (exit 2);
- starts again a worker that dies later, at once, then after a delay doubling from ``BACKOFF_S`` to
  ``MAX_BACKOFF_S`` while it keeps dying within ``STABLE_S`` of its start (logged and counted);
- passes SIGTERM and SIGINT on, exits once every worker has drained (0 if all stopped cleanly), and
  kills one still alive ``KILL_GRACE_S`` after the drain timeout;
- relays an admin drain or undrain that reached one worker to the others, and to workers started
  later.

A worker whose supervisor is gone sees their pipe close and drains: it never keeps the port alone.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from prometheus_client.multiprocess import mark_process_dead

from kvroute.router.config import RouterSettings
from kvroute.router.fleet.membership import Fleet
from kvroute.router.worker_metrics import MULTIPROC_ENV

log = logging.getLogger("kvroute.router.workers")

BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0
STABLE_S = 30.0  # a worker that lived this long had no trouble starting: its backoff starts over
# after the drain timeout: the cutoff's grace (2 s) and the server's shutdown (2 s) fit in it
KILL_GRACE_S = 10.0
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


ADMIN_OPS = ("drain", "undrain")


@dataclass
class WorkerRole:
    """What a worker process is told: which one it is, the replicas drained by the admin API so
    far, and its end of the pipe to the supervisor (messages are (kind, value) tuples)."""

    index: int
    restarted: bool  # a replacement for one that died
    drained: tuple[str, ...]
    pipe: Connection

    def listening(self, url: str) -> None:
        self.pipe.send(("listening", url))

    def tell_others(self, op: str, replica: str) -> None:
        """An admin drain or undrain this worker applied: the supervisor has every other one apply it."""
        self.pipe.send((op, replica))

    def follow(self, fleet: Fleet, on_orphaned: Callable[[], None]) -> None:
        """Apply the drains so far, then those the supervisor relays; ``on_orphaned()`` once the
        supervisor is gone (its end of the pipe closed)."""
        loop = asyncio.get_running_loop()
        fd = self.pipe.fileno()
        pending: set[asyncio.Task[bool]] = set()

        def apply(op: str, replica: str) -> None:
            task = loop.create_task(fleet.drain(replica) if op == "drain" else fleet.undrain(replica))
            pending.add(task)
            task.add_done_callback(pending.discard)

        def readable() -> None:
            try:
                while self.pipe.poll():
                    op, replica = self.pipe.recv()
                    if op in ADMIN_OPS:
                        apply(op, replica)
            except (EOFError, OSError):
                loop.remove_reader(fd)
                log.warning("the supervisor is gone: draining")
                on_orphaned()

        for replica in self.drained:
            apply("drain", replica)
        loop.add_reader(fd, readable)


# what each worker process runs (module-level, so that a spawned interpreter can import it)
WorkerMain = Callable[[RouterSettings, WorkerRole], None]


async def _readable(fd: int) -> None:
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
    try:
        await ready
    finally:
        loop.remove_reader(fd)


class Supervisor:
    def __init__(self, settings: RouterSettings, metrics_dir: str, worker_main: WorkerMain):
        self.settings = settings
        self.worker_main = worker_main
        self.metrics_dir = metrics_dir
        self.restarts = 0
        self._spawn = multiprocessing.get_context("spawn")
        self._procs: dict[int, BaseProcess] = {}
        self._pipes: dict[int, Connection] = {}
        self._drained: set[str] = set()  # by the admin API, for workers started later
        self._stopping = asyncio.Event()
        self._failed: str | None = None

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in _STOP_SIGNALS:
            loop.add_signal_handler(sig, self.stop, sig)
        n = self.settings.workers
        listening = [loop.create_future() for _ in range(n)]
        announce = asyncio.create_task(self._announce(listening))
        codes = await asyncio.gather(*(self._keep(i, listening[i]) for i in range(n)))
        announce.cancel()
        if self._failed is not None:
            print(f"kvroute router: {self._failed}", file=sys.stderr)
            return 2
        clean = (None, 0, -signal.SIGTERM, -signal.SIGINT)  # a signal's default action: stopped as asked
        return 0 if all(code in clean for code in codes) else 1

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Pass ``sig`` on to every worker (each drains); start no more."""
        if not self._stopping.is_set():
            self._stopping.set()
            log.info("%s: the workers drain", signal.Signals(sig).name)
            asyncio.get_running_loop().call_later(self.settings.drain_timeout_s + KILL_GRACE_S, self._kill_all)
        for proc in list(self._procs.values()):
            self._signal(proc, sig)

    async def _announce(self, listening: list[asyncio.Future[str]]) -> None:
        urls = await asyncio.gather(*listening)
        print(f"kvroute router ({len(urls)} workers) listening on {urls[0]}", flush=True)

    async def _keep(self, index: int, listening: asyncio.Future[str]) -> int | None:
        """Keep worker ``index`` running until the stop; its last exit code (None: none ran then)."""
        failures, restarted = 0, False
        while not self._stopping.is_set():
            parent, child = self._spawn.Pipe()
            role = WorkerRole(index, restarted, tuple(sorted(self._drained)), child)
            proc = self._spawn.Process(target=self.worker_main, args=(self.settings, role), name=f"kvroute-worker-{index}")
            proc.start()
            child.close()
            started = time.monotonic()
            self._procs[index], self._pipes[index] = proc, parent
            try:
                await self._follow(index, parent, listening)
                await _readable(proc.sentinel)
            finally:
                proc.join()
                parent.close()
                del self._procs[index], self._pipes[index]
                mark_process_dead(proc.pid, self.metrics_dir)  # its live gauges leave the sums
            code = proc.exitcode
            if self._stopping.is_set():
                return code
            if not listening.done():
                self._fail(f"worker {index} exited with {code} before it listened (its error is above)")
                return code
            if time.monotonic() - started >= STABLE_S:
                failures = 0
            delay = 0.0 if failures == 0 else min(MAX_BACKOFF_S, BACKOFF_S * 2 ** (failures - 1))
            failures += 1
            self.restarts += 1
            log.warning(
                "worker %d (pid %d) exited with %s; starting it again in %.1f s (%d restarts so far)",
                index, proc.pid, code, delay, self.restarts,
            )  # fmt: skip
            try:
                await asyncio.wait_for(self._stopping.wait(), delay)
            except TimeoutError:
                pass
            restarted = True
        return None

    async def _follow(self, index: int, pipe: Connection, listening: asyncio.Future[str]) -> None:
        """Worker ``index``'s messages until its end of the pipe closes (it exited)."""
        while True:
            await _readable(pipe.fileno())
            try:
                kind, value = pipe.recv()
            except (EOFError, OSError):
                return
            if kind == "listening":
                if not listening.done():
                    listening.set_result(value)
            elif kind in ADMIN_OPS:
                (self._drained.add if kind == "drain" else self._drained.discard)(value)
                for other, peer in self._pipes.items():
                    if other != index:
                        try:
                            peer.send((kind, value))
                        except OSError:
                            pass  # exiting: its replacement gets the drained set

    def _fail(self, why: str) -> None:
        if self._failed is None:
            self._failed = why
        self.stop(signal.SIGTERM)

    def _kill_all(self) -> None:
        for proc in list(self._procs.values()):
            log.warning("worker %s (pid %d) still running past the drain timeout: killed", proc.name, proc.pid)
            self._signal(proc, signal.SIGKILL)

    @staticmethod
    def _signal(proc: BaseProcess, sig: int) -> None:
        if proc.pid is not None:
            try:
                os.kill(proc.pid, sig)
            except ProcessLookupError:
                pass  # exited meanwhile


def supervise(settings: RouterSettings, worker_main: WorkerMain) -> int:
    """Run ``settings.workers`` processes of ``worker_main`` until SIGTERM/SIGINT; the exit status."""
    metrics_dir = tempfile.mkdtemp(prefix="kvroute-metrics-")
    os.environ[MULTIPROC_ENV] = metrics_dir  # the workers inherit it: prometheus-client reads it at import
    try:
        return asyncio.run(Supervisor(settings, metrics_dir, worker_main).run())
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)
