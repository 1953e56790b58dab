"""Run one real vLLM replica as a child process and keep its Redis registration true.

Lifecycle:
1. start vLLM (its own process group, so its engine-core process is stopped with it);
2. wait for ``/health``; read the block size and KV capacity (``num_gpu_blocks``) it actually
   runs with from ``/metrics`` (vLLM may round or override what it was asked for);
3. register in Redis (URL, model, KV-event endpoints as routers dial them, block size, capacity)
   and heartbeat with a TTL, so a crashed launcher disappears by itself;
4. on SIGTERM/SIGINT: deregister first (routers stop sending), wait until the requests in
   flight finish (bounded), then stop vLLM;
5. if vLLM exits on its own: deregister and exit with its exit code (non-zero).  Nothing is
   restarted silently: whatever supervises the launcher (systemd, Kubernetes) decides.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shlex
import signal
import ssl
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import aiohttp

from kvroute.common.registration import KeptRegistration, ReplicaRecord
from kvroute.common.scrape import ScrapeResult, parse_vllm_metrics
from kvroute.common.tls import client_context

from kvroute.replica.vllm import VllmReplicaConfig, build_command, build_env

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Registration:
    redis_url: str
    key_prefix: str = "kvroute"
    name: str | None = None  # default: the replica's URL
    ttl: float = 15.0
    secret: bytes | None = field(default=None, repr=False)  # signs the registration (never printed)


@dataclass(frozen=True)
class Timeouts:
    startup: float = 600.0  # vLLM up and healthy (CPU under load: ~1 min; a large GPU model: minutes)
    # Routers list registrations every few seconds: one that listed us just before the
    # deregistration may still send a request during this grace period.
    drain_grace: float = 3.0
    drain: float = 30.0  # in-flight requests to finish after a stop was asked for
    stop: float = 20.0  # vLLM to exit after SIGTERM, before SIGKILL


class StartupError(RuntimeError):
    pass


def exit_code(returncode: int) -> int:
    """A shell-style exit code for the launcher when vLLM ended on its own: never 0."""
    if returncode < 0:
        return 128 - returncode  # killed by a signal
    return returncode or 1


class VllmSupervisor:
    def __init__(
        self,
        config: VllmReplicaConfig,
        registration: Registration | None = None,
        timeouts: Timeouts = Timeouts(),
        log_path: str | None = None,
        client_cert: tuple[str, str] | None = None,  # (cert, key) for an HTTPS vLLM that requires one
    ) -> None:
        self.config = config
        self.client_cert = client_cert
        self._ssl = self._tls()  # now: a client certificate that cannot be loaded stops the launch here
        self.registration = registration
        self.timeouts = timeouts
        self.log_path = log_path
        self.proc: asyncio.subprocess.Process | None = None
        self.record: ReplicaRecord | None = None
        self._http: aiohttp.ClientSession | None = None
        self._registered: KeptRegistration | None = None
        self._exited: asyncio.Future[int] | None = None  # done when vLLM has exited
        self._stopping: asyncio.Future[bool] | None = None  # done when a stop was asked for
        self._log_file: IO[bytes] | None = None

    @property
    def base_url(self) -> str:
        """Where this launcher reaches vLLM (loopback when it binds every interface)."""
        host = self.config.host
        if host in ("", "0.0.0.0", "*"):
            host = "127.0.0.1"
        elif host == "::":
            host = "::1"
        scheme = self.config.scheme
        return f"{scheme}://[{host}]:{self.config.port}" if ":" in host else f"{scheme}://{host}:{self.config.port}"

    def _tls(self) -> ssl.SSLContext | bool:
        """The launcher's TLS towards its own vLLM (True: plain HTTP, aiohttp's default).  It dials
        its child on loopback, where the certificate (made for the name routers use) cannot match,
        so the server is not verified; with ``client_cert`` it presents that certificate, for a
        vLLM that requires one (--ssl-cert-reqs 2)."""
        if self.config.scheme != "https":
            return True
        cert, key = self.client_cert if self.client_cert else (None, None)
        ctx = client_context(None, cert and Path(cert), key and Path(key),
                             names=("", "--ssl-client-certfile", "--ssl-client-keyfile"))
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        return ctx

    async def run(self, stop: asyncio.Event) -> int:
        """Run until ``stop`` is set (returns 0) or vLLM exits by itself (returns its exit code)."""
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5),
                                           connector=aiohttp.TCPConnector(ssl=self._ssl))
        self._stopping = asyncio.ensure_future(stop.wait())
        try:
            await self._start()
            ready = await self._wait_until_healthy()
            if not ready:  # a stop was asked for during startup
                await self._stop_vllm()
                return 0
            try:
                scrape = await self._scrape()
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
                raise StartupError(f"vLLM is healthy but its /metrics cannot be read: {exc!r}") from exc
            self.record = self._make_record(scrape)
            await self._register()
            self._announce()
            return await self._serve()
        except StartupError as exc:
            log.error("%s", exc)
            if self._exited is not None and self._exited.done():
                return exit_code(self._exited.result())
            await self._stop_vllm()
            return 1
        finally:
            await self._cleanup()

    # -- steps --------------------------------------------------------------------------------
    async def _start(self) -> None:
        cmd = build_command(self.config)
        log.info("starting vLLM: %s", shlex.join(cmd))
        out = open(self.log_path, "ab") if self.log_path else None  # noqa: SIM115 - closed in _cleanup
        self._log_file = out
        self.proc = await asyncio.create_subprocess_exec(
            *cmd, env=build_env(self.config), stdin=asyncio.subprocess.DEVNULL,
            stdout=out, stderr=asyncio.subprocess.STDOUT if out else None,
            start_new_session=True,  # its own process group: stopped as a whole, and no terminal Ctrl-C reaches it
        )
        self._exited = asyncio.ensure_future(self.proc.wait())

    async def _wait_exit_or_stop(self, timeout: float | None = None) -> None:
        assert self._exited is not None and self._stopping is not None
        await asyncio.wait({self._exited, self._stopping}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)

    async def _wait_until_healthy(self) -> bool:
        """True once /health answers 200; False if a stop is asked for first."""
        assert self.proc is not None and self._http is not None
        assert self._exited is not None and self._stopping is not None
        started = time.monotonic()
        while True:
            if self._exited.done():
                raise StartupError(f"vLLM exited with code {self.proc.returncode} before it was healthy"
                                   + (f" (its log: {self.log_path})" if self.log_path else ""))
            if self._stopping.done():
                return False
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, OSError):
                async with self._http.get(f"{self.base_url}/health") as resp:
                    if resp.status == 200:
                        log.info("vLLM healthy after %.1f s", time.monotonic() - started)
                        return True
            if time.monotonic() - started > self.timeouts.startup:
                raise StartupError(f"vLLM not healthy after {self.timeouts.startup:.0f} s")
            await self._wait_exit_or_stop(timeout=0.5)

    async def _scrape(self) -> ScrapeResult:
        assert self._http is not None
        async with self._http.get(f"{self.base_url}/metrics") as resp:
            resp.raise_for_status()
            return parse_vllm_metrics(await resp.text())

    def _make_record(self, scrape: ScrapeResult) -> ReplicaRecord:
        cfg = self.config
        if scrape.block_size is not None and scrape.block_size != cfg.effective_block_size:
            log.warning("vLLM runs with block size %d, not the %d asked for: registering %d",
                        scrape.block_size, cfg.effective_block_size, scrape.block_size)
        return ReplicaRecord(
            url=cfg.url,
            name=(self.registration.name if self.registration else None) or "",
            model=cfg.model,
            events_endpoint=cfg.public_events_endpoint,
            replay_endpoint=cfg.public_replay_endpoint,
            block_size=scrape.block_size or cfg.effective_block_size,
            capacity_blocks=scrape.capacity_blocks,
            engine="vllm",
        )

    async def _register(self) -> None:
        if self.registration is None or self.record is None:
            return
        reg = self.registration
        self._registered = KeptRegistration(reg.redis_url, reg.key_prefix, self.record, reg.ttl, secret=reg.secret)
        await self._registered.start()

    def _announce(self) -> None:
        r = self.record
        assert r is not None
        events = f" events {r.events_endpoint}" if r.events_endpoint else ""
        replay = f" replay {r.replay_endpoint}" if r.replay_endpoint else ""
        # The same line as the emulated replica prints: scripts and tests read it.
        print(f"{r.url} model={r.model} block_size={r.block_size} num_gpu_blocks={r.capacity_blocks}"
              f"{events}{replay}", flush=True)

    async def _serve(self) -> int:
        assert self.proc is not None and self._exited is not None
        await self._wait_exit_or_stop()
        if self._exited.done():
            code = self.proc.returncode
            log.error("vLLM exited on its own with code %d: deregistering, not restarting", code)
            await self._deregister()
            await self._stop_vllm()
            return exit_code(code)
        log.info("stopping: deregistering, draining, then stopping vLLM")
        await self._deregister()
        await self._drain()
        await self._stop_vllm()
        return 0

    async def _deregister(self) -> None:
        if self._registered is not None:
            await self._registered.deregister()

    async def _drain(self) -> None:
        """Wait until vLLM has no request running or waiting (bounded by the drain timeout)."""
        assert self.proc is not None
        started = time.monotonic()
        deadline = started + self.timeouts.drain
        grace_until = started + min(self.timeouts.drain_grace, self.timeouts.drain)
        while not self._exited.done():  # type: ignore[union-attr]
            now = time.monotonic()
            if now >= deadline:
                log.warning("drain timed out after %.0f s: stopping vLLM with requests in flight", self.timeouts.drain)
                return
            try:
                scrape = await self._scrape()
                busy = scrape.running + scrape.waiting
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
                return  # it no longer answers: nothing left to drain through it
            if busy == 0 and now >= grace_until:
                log.info("drained in %.1f s", now - started)
                return
            await asyncio.sleep(0.25)

    async def _stop_vllm(self) -> None:
        if self.proc is None or self._exited is None:
            return
        if self._exited.done():
            # Its engine-core process outlives an API server that crashed: it is in the same
            # process group, and must not keep the KV cache's memory.
            self._signal_group(signal.SIGKILL)
            return
        self._signal_group(signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.shield(self._exited), self.timeouts.stop)
        except asyncio.TimeoutError:
            log.warning("vLLM still running %.0f s after SIGTERM: killing it", self.timeouts.stop)
            self._signal_group(signal.SIGKILL)
            await self._exited
        self._signal_group(signal.SIGKILL)  # stragglers of the group, if any

    def _signal_group(self, sig: int) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    async def _cleanup(self) -> None:
        if self._registered is not None:
            await self._registered.close()  # heartbeats end; a registration not undone lapses
        await self._stop_vllm()
        if self._stopping is not None:
            self._stopping.cancel()
        if self._http is not None:
            await self._http.close()
        if self._log_file is not None:
            self._log_file.close()
