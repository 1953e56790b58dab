"""Server-sent events as the router relays them: framed across chunk boundaries, scanned for the
few events it must read, passed on untouched otherwise.

The only parsing is what the router needs: each chunk is scanned for a usage object (a regex
search, in C) and only events that carry one are decoded, to read ``cached_tokens`` and to
withhold the usage-only chunk from a client that did not ask for it; a replica's in-stream error
is rewritten in OpenAI's shape, and a Responses stream's last event (its answer) is kept for the
caller.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import msgspec

from kvroute.router.forwarding.replica_errors import error_payload

_decode = msgspec.json.Decoder()
_encode = msgspec.json.Encoder()
_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")
_DONE = b"[DONE]"
# a usage object (not the "usage": null every OpenAI-style chunk carries), an error event in a
# shape that may need rewriting (replica_errors.py), or a Responses stream's last event: only
# then decode.  Text inside a JSON string
# cannot match (its quotes are escaped).
_LOOK = re.compile(  # one leading quote: the search stops only at quotes (~1 us on a 200-byte chunk)
    rb'"(?:usage"\s*:\s*\{|error"\s*:|object"\s*:\s*"error"|detail"\s*:'
    rb'|type"\s*:\s*"response\.(?:completed|incomplete|failed)")'
)
# the last event of a Responses API stream
_RESPONSE_END = frozenset({"response.completed", "response.incomplete", "response.failed"})


@dataclass(frozen=True, slots=True)
class Usage:
    """The token counts an answer reports (``usage``), as far as it reports them."""

    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None

    @classmethod
    def from_json(cls, usage: Any) -> Usage | None:
        """Chat/completions usage, or the Responses API's (input/output tokens)."""
        if not isinstance(usage, dict):
            return None
        if "prompt_tokens" not in usage and "input_tokens" in usage:
            prompt, details, completion = usage.get("input_tokens"), usage.get("input_tokens_details"), usage.get("output_tokens")
        else:
            prompt, details, completion = usage.get("prompt_tokens"), usage.get("prompt_tokens_details"), usage.get("completion_tokens")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return cls(
            prompt_tokens=_int_or_none(prompt),
            cached_tokens=_int_or_none(cached),
            completion_tokens=_int_or_none(completion),
        )


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class SseRelay:
    """Frames SSE events across chunk boundaries, reads usage, withholds the usage-only chunk."""

    __slots__ = ("strip_usage", "usage", "done", "answer", "events", "_pending")

    def __init__(self, strip_usage: bool):
        self.strip_usage = strip_usage
        self.usage: Usage | None = None
        self.done = False
        # a Responses stream's final response object, once its last event was fed: the caller reads
        # it before it sends the client the bytes that hold it
        self.answer: dict[str, Any] | None = None
        # data events before [DONE]: the output tokens of a stream whose replica reports no usage
        # (vLLM streams one token an event); JSON escapes newlines, so a blank line ends an event
        self.events = 0
        self._pending = b""

    def feed(self, chunk: bytes) -> bytes:
        """Bytes to send the client now: every complete event so far, minus withheld ones."""
        data = self._pending + chunk if self._pending else chunk
        cut = _last_event_end(data)
        if cut == 0:
            self._pending = data
            return b""
        complete, self._pending = data[:cut], data[cut:]
        # events in it (whole ones only): the common case one C-speed count
        self.events += complete.count(b"\n\n") if b"\r" not in complete else len(_EVENT_END.findall(complete))
        if _DONE in complete:
            self.done = True
            self.events -= 1
        if _LOOK.search(complete) is None:
            return complete  # the common case: forwarded untouched, nothing decoded
        return b"".join(self._filter(ev) for ev in _split_events(complete))

    def _filter(self, event: bytes) -> bytes:
        if _LOOK.search(event) is None:
            return event
        payload = _event_json(event)
        if not isinstance(payload, dict):
            return event
        if payload.get("type") in _RESPONSE_END and isinstance(payload.get("response"), dict):
            # the Responses API ends its stream with this event (no [DONE]); it carries the usage
            self.done = True
            response = payload["response"]
            self.usage = Usage.from_json(response.get("usage")) or self.usage
            self.answer = response
            return event
        if not isinstance(payload.get("usage"), dict):
            rewritten = error_payload(payload, 500)  # a replica's in-stream error, in OpenAI's shape
            return event if rewritten is None else b"data: " + _encode.encode(rewritten) + b"\n\n"
        self.usage = Usage.from_json(payload["usage"]) or self.usage
        if not self.strip_usage:
            return event
        if not payload.get("choices"):
            return b""  # the usage-only chunk the router asked for on the client's behalf
        payload.pop("usage")
        return b"data: " + _encode.encode(payload) + b"\n\n"

    def tail(self) -> bytes:
        """An unterminated last event, if the stream ended without its blank line."""
        rest, self._pending = self._pending, b""
        if rest.strip():
            if _DONE in rest:
                self.done = True
            return self._filter(rest) + b"\n\n"
        return b""


def _last_event_end(data: bytes) -> int:
    """Offset just past the last complete event (0 if none): a blank line ends an event."""
    if b"\r" not in data:  # what every engine sends: one C-speed search from the end
        i = data.rfind(b"\n\n")
        return i + 2 if i >= 0 else 0
    end = 0
    for m in _EVENT_END.finditer(data):
        end = m.end()
    return end


def _split_events(data: bytes) -> list[bytes]:
    events, start = [], 0
    for m in _EVENT_END.finditer(data):
        events.append(data[start : m.end()])
        start = m.end()
    return events


def _event_json(event: bytes) -> Any:
    lines = [ln[5:].lstrip() for ln in event.splitlines() if ln.startswith(b"data:")]
    if not lines:
        return None
    try:
        return _decode.decode(b"\n".join(lines))
    except msgspec.DecodeError:
        return None
