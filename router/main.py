"""``kvroute router``: the router's process.  ``main(argv)`` reads the settings (flags, environment,
config file), sets up logging, then serves in this process, or with ``--workers N`` has a
supervisor (router/workers.py) run N processes that each serve.

``serve`` runs one router (router/app.py's ``RouterApp``) until SIGTERM or SIGINT (a worker: also
its supervisor's end), then drains: /ready turns 503 while requests in flight finish (up to
``drain_timeout_s``, then router/edge/cutoff.py ends the rest), and the process exits.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import sys

from pydantic import ValidationError

from kvroute.common.logs import configure_logging

from kvroute.router.app import RouterApp
from kvroute.router.config import RouterSettings, load_settings
from kvroute.router.edge.connections import raise_open_file_limit
from kvroute.router.workers import WorkerRole, supervise

log = logging.getLogger("kvroute.router")


async def serve(settings: RouterSettings, *, worker: WorkerRole | None = None) -> None:
    """Run until SIGTERM/SIGINT (or, a worker, its supervisor's end); then drain and stop."""
    before, soft, hard = raise_open_file_limit()  # every connection is a descriptor (docs/design.md §7.5)
    if soft != before:
        log.info("open-file limit raised from %d to %d (the hard limit %d)", before, soft, hard)
    else:
        log.info("open-file limit %d (hard limit %d)", soft, hard)
    app = RouterApp(settings, worker=worker)
    await app.start()
    # Everything alive now (modules, tokenizers, settings) lives as long as the process: keep it out
    # of the collector's generations, and collect the young one less often (requests allocate a lot).
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 50, 100)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if worker is None:
        print(f"kvroute router listening on {app.url}", flush=True)
    else:
        worker.listening(app.url)  # the supervisor announces once all workers listen
        worker.follow(app.fleet, on_orphaned=stop.set)
    try:
        await stop.wait()
        log.info("signal received: draining (%d in flight)", app.in_flight)
        if not await app.drain():
            await app.cutoff.cut()  # the timeout passed: end what is left, then exit
    finally:
        await app.stop()


def serve_worker(settings: RouterSettings, role: WorkerRole) -> None:
    """A worker process (the supervisor starts it): one router until a signal, or the supervisor's end."""
    import uvloop

    configure_logging(settings.log_level, settings.log_format)
    for handler in logging.getLogger().handlers:  # every line says which worker wrote it
        handler.addFilter(_WorkerTag(role.index))
    try:
        uvloop.run(serve(settings, worker=role))
    except (ValueError, OSError) as exc:  # a tokenizer path, a policy name, a port in use
        print(f"kvroute router worker {role.index}: {exc}", file=sys.stderr)
        sys.exit(2)


class _WorkerTag(logging.Filter):
    """Adds ``worker`` to every record: a field of JSON lines, ``worker=N`` at the end of text ones."""

    def __init__(self, index: int):
        super().__init__()
        self.index = index

    def filter(self, record: logging.LogRecord) -> bool:
        record.worker = self.index
        return True


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        settings = load_settings(argv)
    except SystemExit as exc:  # --help, or a flag argparse rejected (it printed why)
        return int(exc.code or 0)
    except (ValidationError, ValueError, OSError) as exc:
        print(f"kvroute router: invalid settings: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level, settings.log_format)
    if settings.workers > 1:
        return supervise(settings, serve_worker)
    import uvloop

    try:
        uvloop.run(serve(settings))
    except (ValueError, OSError) as exc:  # a tokenizer path, a policy name, a port in use
        print(f"kvroute router: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
