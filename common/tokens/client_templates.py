"""Clients' own chat templates, rendered in worker processes with a time and an output budget.

A template is a program: ``{% for i in range(100000) %}{% for j in range(1000) %}…`` runs for
seconds, and on the event loop it stalls every request of the router.  So a request's
``chat_template`` renders in a separate process (sandboxed Jinja as always, see
common/tokens/template_worker.py); a job over the time budget gets its worker SIGKILLed and
replaced, a job over the output budget is stopped by the worker; both refuse the request
(:class:`ClientTemplateRefused`).  ``workers`` jobs run at a time; the others wait at most
``queue_timeout_s`` for a worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from typing import Any

import msgspec

from kvroute.common.tokens.chat_template import ChatTemplateError, RenderJob
from kvroute.common.tokens.errors import ClientTemplateRefused
from kvroute.common.tokens.template_worker import HEADER  # the wire format is defined by the worker

log = logging.getLogger(__name__)

# this interpreter, with our environment: it finds kvroute where this process did (installed)
_WORKER_MAIN = "import sys; from kvroute.common.tokens.template_worker import main; sys.exit(main(sys.argv))"
_START_TIMEOUT_S = 30.0  # a worker's interpreter start, on a loaded host
_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(dict).decode


class _Worker:
    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc

    @classmethod
    async def spawn(cls, max_output_chars: int) -> _Worker:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _WORKER_MAIN, str(max_output_chars),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )
        worker = cls(proc)
        try:
            async with asyncio.timeout(_START_TIMEOUT_S):
                await worker.read_reply()  # "ready": the interpreter and imports are loaded
        except BaseException:
            await worker.kill()
            raise
        return worker

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None

    async def call(self, payload: bytes) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(HEADER.pack(len(payload)) + payload)
        await self.proc.stdin.drain()
        return await self.read_reply()

    async def read_reply(self) -> dict:
        assert self.proc.stdout is not None
        (size,) = HEADER.unpack(await self.proc.stdout.readexactly(HEADER.size))
        return _decode(await self.proc.stdout.readexactly(size))

    async def kill(self) -> None:
        if self.alive:
            self.proc.kill()
        await self.proc.wait()


class ClientTemplates:
    """The worker processes of client templates; :meth:`start` them, :meth:`aclose` them.

    Each slot of the pool holds a worker being started or ready; a worker killed after an
    overrun is replaced at once in the background, so the next job does not wait for a new
    interpreter (a start takes ~0.5-1 s).
    """

    def __init__(self, *, timeout_s: float = 1.0, max_output_chars: int = 16 << 20, workers: int = 1,
                 queue_timeout_s: float | None = None):
        self.timeout_s = timeout_s
        self.max_output_chars = max_output_chars
        self.queue_timeout_s = queue_timeout_s if queue_timeout_s is not None else 5 * timeout_s
        self._slots: asyncio.Queue[asyncio.Future[_Worker] | None] = asyncio.Queue()
        for _ in range(workers):
            self._slots.put_nowait(None)  # started by start() or the first job
        self._all: set[_Worker] = set()
        self._closed = False
        self._background: set[asyncio.Future] = set()  # kills and restarts under way (kept referenced)

    def start(self) -> None:
        """Start every worker now, in the background, rather than on the first job."""
        slots = [self._slots.get_nowait() for _ in range(self._slots.qsize())]
        for slot in slots:
            self._slots.put_nowait(slot or self._in_background(self._spawn()))

    async def render(self, job: RenderJob) -> str:
        """The rendered prompt; ChatTemplateError if the template fails, ClientTemplateRefused
        over a budget or when no worker frees up in time."""
        try:
            payload = _encode(job)
        except (msgspec.EncodeError, TypeError, OverflowError) as exc:
            raise ChatTemplateError(f"these messages cannot be sent to the template worker: {exc}") from exc
        try:
            async with asyncio.timeout(self.queue_timeout_s):
                slot = await self._slots.get()
        except TimeoutError:
            raise ClientTemplateRefused(
                f"every chat-template worker stayed busy for {self.queue_timeout_s:g} s; retry later",
                "chat_template_busy", status=429) from None
        worker: _Worker | None = None
        healthy = False
        try:
            # a worker's start is not timed: the job's budget starts with the job
            worker = await (slot or self._spawn())
            if not worker.alive:  # died while idle (the OOM killer, an operator): start another
                self._all.discard(worker)
                worker = await self._spawn()
            reply = await self._timed_call(worker, payload)
            healthy = reply.get("code") != "chat_template_memory_exceeded"  # that worker has exited
        except OSError as exc:
            raise ClientTemplateRefused(f"the chat template worker could not start: {exc}", "chat_template_failed") from None
        finally:
            # a worker that overran or was interrupted mid-job is in an unknown state: replace it
            if not healthy and worker is not None:
                self._all.discard(worker)
                self._in_background(worker.kill())
            if healthy:
                self._slots.put_nowait(asyncio.ensure_future(_ready(worker)))
            else:
                self._slots.put_nowait(None if self._closed else self._in_background(self._spawn()))
        if "text" in reply:
            return reply["text"]
        if "refused" in reply:
            raise ClientTemplateRefused(reply["refused"], reply.get("code", "chat_template_refused"))
        raise ChatTemplateError(reply.get("error", "chat template failed"))

    def worker_pids(self) -> list[int]:
        """The worker processes started and not yet killed."""
        return sorted(w.proc.pid for w in self._all if w.alive)

    def _in_background(self, coro: Any) -> asyncio.Future:
        future = asyncio.ensure_future(coro)
        self._background.add(future)
        future.add_done_callback(self._background.discard)
        return future

    async def _timed_call(self, worker: _Worker, payload: bytes) -> dict:
        try:
            async with asyncio.timeout(self.timeout_s):
                return await worker.call(payload)
        except TimeoutError:
            log.warning("a client chat template ran past its %g s budget: its worker is killed and replaced", self.timeout_s)
            raise ClientTemplateRefused(
                f"the chat template did not finish rendering within {self.timeout_s:g} s, this router's budget",
                "chat_template_timeout") from None
        except (ConnectionError, asyncio.IncompleteReadError) as exc:
            raise ClientTemplateRefused(f"the chat template worker failed: {exc!r}", "chat_template_failed") from None

    async def _spawn(self) -> _Worker:
        worker = await _Worker.spawn(self.max_output_chars)
        self._all.add(worker)
        if self._closed:  # closed while this one started
            await worker.kill()
        return worker

    async def aclose(self) -> None:
        self._closed = True
        while not self._slots.empty():
            slot = self._slots.get_nowait()
            if slot is not None and not slot.done():
                slot.cancel()
        for worker in list(self._all):
            self._all.discard(worker)
            with contextlib.suppress(ProcessLookupError):
                await worker.kill()


async def _ready(worker: _Worker) -> _Worker:
    return worker
