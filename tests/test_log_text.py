"""The text log format (common/logs.py): any message and any field values, whatever characters
they hold, make one line that parse_text_line reads back to the same values."""

from __future__ import annotations

import logging
import sys

from hypothesis import given
from hypothesis import strategies as st

from kvroute.common.logs import TextFormatter, escape_text, parse_text_line

FORMAT = TextFormatter()
KEYS = st.from_regex(r"[a-z][a-z_]{0,11}", fullmatch=True).filter(lambda k: k not in logging.LogRecord(
    "", 0, "", 0, "", None, None).__dict__ and k not in ("message", "asctime", "taskName", "exc"))


def record(msg: str, fields: dict[str, str], exc_info=None) -> logging.LogRecord:
    rec = logging.LogRecord("kvroute.access", logging.INFO, "", 0, "%s", (msg,), exc_info)
    rec.__dict__.update(fields)
    return rec


@given(st.text(), st.dictionaries(KEYS, st.text(), max_size=5))
def test_any_message_and_fields_make_one_line_read_back_as_they_were(msg, fields):
    line = FORMAT.format(record(msg, fields))
    assert len(line.splitlines()) == 1 and line.isprintable()
    parsed = parse_text_line(line)
    assert (parsed.level, parsed.logger, parsed.msg, parsed.fields) == ("INFO", "kvroute.access", msg, fields)


def test_controls_and_terminal_escapes_are_visible_and_plain_text_is_untouched():
    assert escape_text("a\r\nb\x1b[31m\x00\x7f\u202e\u2028\\") == "a\\r\\nb\\x1b[31m\\x00\\x7f\\u202e\\u2028\\\\"
    assert escape_text("POST /v1/chat/completions 200 é 中") == "POST /v1/chat/completions 200 é 中"


def test_a_traceback_is_a_field_of_the_same_line():
    try:
        raise ValueError("bad\n2026-12-04 00:00:00,000 INFO kvroute.access: forged")
    except ValueError:
        line = FORMAT.format(record("failed", {}, sys.exc_info()))
    assert len(line.splitlines()) == 1
    parsed = parse_text_line(line)
    assert parsed.msg == "failed" and parsed.fields["exc"].endswith("ValueError: bad\n2026-12-04 00:00:00,000 INFO "
                                                                   "kvroute.access: forged")
