"""Logging of the kvroute processes (router, replica, launcher): text or JSON lines, written off the loop.

``--log-format json`` writes one JSON object per line: ``ts`` (UTC, ISO 8601 with milliseconds),
``level``, ``logger``, ``msg``, the fields a call passed as ``extra=`` (the access log's request id,
replica, tokens ...) and ``exc`` with a traceback.  ``text`` is the classic line, with the extra
fields appended as ``key=value``.

Records are formatted where they are logged and queued as lines; one thread writes them, what
queued since its last write in one call (``python -m kvroute.bench.access_log_cost`` measures the cost),
so a slow stderr (a full pipe, a stalled log collector) never blocks the event loop.
"""

from __future__ import annotations

import atexit
import logging
import queue
import sys
import threading
import time
from typing import IO, Any, Literal

import msgspec

LogFormat = Literal["text", "json"]

# the attributes every LogRecord has: whatever else it carries came from ``extra=``
_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime", "taskName"}
MAX_QUEUED = 100_000  # log lines waiting for the writer thread; more are dropped (counted)
_json = msgspec.json.Encoder(enc_hook=str)  # an odd extra value is written as its str()


def extra_fields(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in record.__dict__.items() if k not in _STANDARD and not k.startswith("_")}


_second: list[Any] = [None, ""]  # the last second formatted, and its text


def _timestamp(created: float) -> str:
    secs = int(created)
    if _second[0] != secs:
        _second[:] = [secs, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(secs))]
    return f"{_second[1]}.{int((created - secs) * 1000):03d}Z"


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts, level, logger, msg, the extra fields, exc."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": _timestamp(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update(extra_fields(record))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc"] = record.exc_text
        return _json.encode(out).decode()


class TextFormatter(logging.Formatter):
    """``ts LEVEL logger: msg key=value ...``"""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extra = extra_fields(record)
        if not extra:
            return line
        head, sep, tail = line.partition("\n")  # a traceback stays below the fields
        fields = " ".join(f"{k}={v}" for k, v in extra.items() if v is not None)
        return f"{head} {fields}{sep}{tail}"


def make_formatter(fmt: LogFormat) -> logging.Formatter:
    if fmt == "json":
        return JsonFormatter()
    if fmt == "text":
        return TextFormatter()
    raise ValueError(f"log format must be 'text' or 'json', not {fmt!r}")


class _LineWriter:
    """The one thread that writes log lines: it takes what has queued since its last write and
    writes it in one call, then pauses ``pause_s``, so a busy router wakes it a few hundred times
    a second at most instead of once per line."""

    def __init__(self, stream: IO[str], pause_s: float = 0.005):
        self.stream = stream
        self.pause_s = pause_s
        self.queue: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self.dropped = 0  # lines refused while the queue was full
        self._thread = threading.Thread(target=self._run, name="kvroute-log-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        q = self.queue
        while True:
            lines = [q.get()]
            while not q.empty():
                lines.append(q.get_nowait())
            stop = lines[-1] is None
            text = "".join(f"{line}\n" for line in lines if line is not None)
            if self.dropped:
                dropped, self.dropped = self.dropped, 0
                text += f"kvroute: {dropped} log lines dropped: stderr did not keep up\n"
            try:
                self.stream.write(text)
                self.stream.flush()
            except (OSError, ValueError):  # a closed or broken stderr: nothing left to tell
                pass
            if stop:
                return
            time.sleep(self.pause_s)

    def stop(self) -> None:
        """Write what is queued, then end the thread."""
        self.queue.put(None)
        self._thread.join(timeout=5)


class _QueueLineHandler(logging.Handler):
    """Formats a record where it is logged and queues only its line; past ``MAX_QUEUED`` lines
    waiting (stderr stuck) it drops them, counted, rather than grow without bound."""

    def __init__(self, writer: _LineWriter):
        super().__init__()
        self.writer = writer
        self.put = writer.queue.put
        self.qsize = writer.queue.qsize

    def emit(self, record: logging.LogRecord) -> None:
        if self.qsize() >= MAX_QUEUED:
            self.writer.dropped += 1
            return
        try:
            self.put(self.format(record))
        except Exception:  # noqa: BLE001 - logging must never raise into the caller
            self.handleError(record)


_writer: _LineWriter | None = None


def configure_logging(level: str, fmt: LogFormat = "text", stream: IO[str] | None = None) -> None:
    """The root logger writes ``fmt`` lines to ``stream`` (stderr) through a writer thread.
    Called once per process; a second call replaces the first setup."""
    global _writer
    stop_logging()
    _writer = _LineWriter(stream or sys.stderr)
    handler = _QueueLineHandler(_writer)
    handler.setFormatter(make_formatter(fmt))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # what no line prints need not be gathered per record (the logging HOWTO's optimizations):
    # the caller's frame walk is the costliest part of a record
    logging._srcfile = None  # type: ignore[attr-defined]  # noqa: SLF001
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    atexit.register(stop_logging)


def stop_logging() -> None:
    """Write what is queued and stop the writer thread (at exit)."""
    global _writer
    if _writer is not None:
        _writer.stop()
        _writer = None
