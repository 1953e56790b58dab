"""Logging of the kvroute processes (router, replica, launcher): text or JSON lines, written off the loop.

``--log-format json`` writes one JSON object per line: ``ts`` (UTC, ISO 8601 with milliseconds),
``level``, ``logger``, ``msg``, the fields a call passed as ``extra=`` (the access log's request id,
replica, tokens ...) and ``exc`` with a traceback.  ``text`` is the classic line, with the extra
fields appended as ``key=value`` (and a traceback as the field ``exc``).

A record is one line in either format, whatever a client sent (docs/design.md §7.8): in text lines
the message and every value are escaped (a backslash and every character Python does not call
printable: controls such as CR, LF and ESC, Unicode line separators, invisible format characters
such as bidi overrides, spaces other than the space, become ``\n``, ``\x1b``, ``\u202e`` ...),
and a value holding a space, ``=`` or ``"`` is quoted, so no value can end a line, forge another or
pass for a field; ``parse_text_line`` reads a line back.

Records are formatted where they are logged and queued as lines; one thread writes them, what
queued since its last write in one call (``python -m kvroute.bench.access_log_cost`` measures the cost),
so a slow stderr (a full pipe, a stalled log collector) never blocks the event loop.
"""

from __future__ import annotations

import atexit
import logging
import queue
import re
import sys
import threading
import time
from dataclasses import dataclass
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


# what may stand in a text line as it is: printable ASCII but the backslash (the escape character)
_PLAIN = re.compile(r"[\x20-\x5b\x5d-\x7e]*")
_UNSAFE = re.compile(r"[^\x20-\x5b\x5d-\x7e]")
_SHORT = {"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape_char(match: re.Match[str]) -> str:
    ch = match.group()
    if ch in _SHORT:
        return _SHORT[ch]
    code = ord(ch)
    # not printable: controls, format characters (bidi overrides, zero-width), separators other
    # than the space, surrogates, private use, unassigned
    if not ch.isprintable():
        return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"
    return ch  # a printable letter of any script stays readable


def escape_text(text: str) -> str:
    """``text`` with nothing that could break or disguise a log line: see the module's docstring."""
    if _PLAIN.fullmatch(text):
        return text  # the common case, one regex pass
    return _UNSAFE.sub(_escape_char, text)


def _quoted(escaped: str) -> str:
    return '"' + escaped.replace('"', '\\"') + '"'


# a value written bare as it is: printable ASCII but the space, '"', '=' and the backslash
_BARE = re.compile(r'[\x21\x23-\x3c\x3e-\x5b\x5d-\x7e]+')


def _value(value: Any) -> str:
    text = str(value)
    if _BARE.fullmatch(text):
        return text  # the common case: ids, numbers, paths, model names
    text = escape_text(text)
    return text if text and not any(c in text for c in ' "=') else _quoted(text)


def _message(msg: str) -> str:
    """Bare unless it could pass for a field (``=``), starts like a quoted one, or is empty."""
    text = escape_text(msg)
    return text if text and "=" not in text and not text.startswith('"') else _quoted(text)


class TextFormatter(logging.Formatter):
    """``ts LEVEL logger: msg key=value ...``, one line per record (a traceback is ``exc=``)."""

    def format(self, record: logging.LogRecord) -> str:
        record.message = record.getMessage()
        head = f"{self.formatTime(record)} {record.levelname} {record.name}: {_message(record.message)}"
        fields = {k: v for k, v in extra_fields(record).items() if v is not None}
        if record.exc_info:
            fields["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            fields["exc"] = record.exc_text
        if not fields:
            return head
        return head + " " + " ".join(f"{k}={_value(v)}" for k, v in fields.items())


@dataclass(frozen=True)
class TextLine:
    """A text log line read back: every value as the record held it (its str), unescaped."""

    ts: str
    level: str
    logger: str
    msg: str
    fields: dict[str, str]


_HEAD = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) (\S+) (\S+?): ")
_QUOTED = r'"(?:[^"\\]|\\.)*"'
_FIELD = re.compile(rf' ([^ ="]+)=({_QUOTED}|[^ "]+)')
_ESCAPE = re.compile(r"\\(?:x[0-9a-f]{2}|u[0-9a-f]{4}|U[0-9a-f]{8}|.)")


def _unescape(text: str) -> str:
    def one(m: re.Match[str]) -> str:
        esc = m.group()[1:]
        return {"n": "\n", "r": "\r", "t": "\t"}.get(esc) or (chr(int(esc[1:], 16)) if len(esc) > 1 else esc)

    return _ESCAPE.sub(one, text)


def _unquote(token: str) -> str:
    return _unescape(token[1:-1] if token.startswith('"') else token)


def parse_text_line(line: str) -> TextLine:
    """A line of the text format back into its parts; ValueError if it is not one."""
    head = _HEAD.match(line)
    if head is None:
        raise ValueError(f"not a kvroute text log line: {line[:200]!r}")
    rest = line[head.end():]
    quoted = re.match(_QUOTED, rest) if rest.startswith('"') else None
    if quoted is not None:
        msg, rest = _unquote(quoted.group()), rest[quoted.end():]
    else:  # a bare message holds no "=": the fields start at the first word that does
        equals = rest.find("=")
        end = len(rest) if equals < 0 else rest.rfind(" ", 0, equals)
        if end < 0:
            raise ValueError(f"a field where the message should be: {line[:200]!r}")
        msg, rest = _unescape(rest[:end]), rest[end:]
    fields: dict[str, str] = {}
    pos = 0
    while pos < len(rest):
        field = _FIELD.match(rest, pos)
        if field is None:
            raise ValueError(f"unreadable fields at {rest[pos:pos + 80]!r}")
        fields[field.group(1)] = _unquote(field.group(2))
        pos = field.end()
    return TextLine(head.group(1), head.group(2), head.group(3), msg, fields)


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
