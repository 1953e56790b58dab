"""Logging of the kvroute processes (router, replica, launcher): text or JSON lines, written off the loop.

``--log-format json`` writes one JSON object per line: ``ts`` (UTC, ISO 8601 with milliseconds),
``level``, ``logger``, ``msg``, the fields a call passed as ``extra=`` (the access log's request id,
replica, tokens ...) and ``exc`` with a traceback.  ``text`` is the classic line, with the extra
fields appended as ``key=value``.

Records are formatted where they are logged (a few microseconds) and queued; one thread writes
them (``QueueHandler``/``QueueListener``), so a slow stderr (a full pipe, a stalled log collector)
never blocks the event loop.
"""

from __future__ import annotations

import atexit
import logging
import logging.handlers
import queue
import sys
import time
from typing import IO, Any, Literal

import msgspec

LogFormat = Literal["text", "json"]

# the attributes every LogRecord has: whatever else it carries came from ``extra=``
_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime", "taskName"}
_json = msgspec.json.Encoder(enc_hook=str)  # an odd extra value is written as its str()


def extra_fields(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in record.__dict__.items() if k not in _STANDARD and not k.startswith("_")}


def _timestamp(created: float) -> str:
    secs = int(created)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(secs)) + f".{int((created - secs) * 1000):03d}Z"


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


class _PreformattedQueueHandler(logging.handlers.QueueHandler):
    """Formats on the caller's side and queues only the line: the writer thread does no work
    that depends on the record, and a record's arguments cannot change before it is written."""

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        line = self.format(record)
        return logging.makeLogRecord({"msg": line, "levelno": record.levelno, "levelname": record.levelname})


_listener: logging.handlers.QueueListener | None = None


def configure_logging(level: str, fmt: LogFormat = "text", stream: IO[str] | None = None) -> None:
    """The root logger writes ``fmt`` lines to ``stream`` (stderr) through a writer thread.
    Called once per process; a second call replaces the first setup."""
    global _listener
    stop_logging()
    sink = logging.StreamHandler(stream or sys.stderr)
    sink.setFormatter(logging.Formatter("%(message)s"))
    q: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
    handler = _PreformattedQueueHandler(q)
    handler.setFormatter(make_formatter(fmt))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    _listener = logging.handlers.QueueListener(q, sink)
    _listener.start()
    atexit.register(stop_logging)


def stop_logging() -> None:
    """Write what is queued and stop the writer thread (at exit)."""
    global _listener
    if _listener is not None:
        _listener.stop()
        _listener = None
