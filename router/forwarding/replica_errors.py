"""A replica's error answer in OpenAI's shape, as the router's own errors are (common/errors.py).

Replicas answer errors in many shapes: OpenAI's ``{"error": {message, type, param, code}}``
(vLLM today, passed through untouched), vLLM ≤0.8's fields at the top level
(``{"object": "error", "message": ...}``), FastAPI's ``{"detail": "..."}`` or its validation list
``{"detail": [{"loc": [...], "msg": ...}]}``, ``{"error": "text"}`` (TGI and others), plain text,
or an HTML page from a proxy in front of the engine.  Each becomes
``{"error": {"message", "type", "param", "code"}}`` with the replica's message, its type and code
when it gave them (else the router's type for the status and the code ``upstream_error``), and
the status unchanged.  In a stream, an error event in any of the JSON shapes is rewritten the same
way (the SDK raises on ``{"error": {...}}`` in an event).
"""

from __future__ import annotations

import html
import re
from typing import Any

import msgspec

from kvroute.common.errors import error_type

MAX_MESSAGE_CHARS = 2000
_decode = msgspec.json.Decoder()
_encode = msgspec.json.Encoder()
_TITLE = re.compile(rb"<title[^>]*>(.*?)</title>", re.IGNORECASE | re.DOTALL)
_TAGS = re.compile(r"<(script|style)\b.*?</\1\s*>|<[^>]+>", re.IGNORECASE | re.DOTALL)
_SPACE = re.compile(r"\s+")


def _error(status: int, message: str, type: Any = None, param: Any = None, code: Any = None) -> dict[str, Any]:
    message = message.strip()[:MAX_MESSAGE_CHARS] or f"replica answered {status}"
    return {
        "error": {
            "message": message,
            "type": type if isinstance(type, str) and type else error_type(status),
            "param": param if param is None or isinstance(param, str) else str(param),
            "code": code if code is not None else "upstream_error",
        }
    }


def _fastapi_detail(detail: Any) -> tuple[str, str | None]:
    """FastAPI's ``detail``: a string, or a validation list of ``{loc, msg}`` (param: the first loc)."""
    if isinstance(detail, list) and detail and all(isinstance(d, dict) for d in detail):
        parts, param = [], None
        for d in detail:
            loc = [str(x) for x in d.get("loc") or [] if x != "body"]
            param = param or (".".join(loc) or None)
            parts.append(f"{'.'.join(loc)}: {d.get('msg')}" if loc else str(d.get("msg")))
        return "; ".join(parts), param
    return (detail if isinstance(detail, str) else msgspec.json.encode(detail).decode()), None


def error_payload(payload: Any, status: int) -> dict[str, Any] | None:
    """``payload`` (decoded JSON) rewritten in OpenAI's shape; None when it already is in it, or
    is not an error at all."""
    if not isinstance(payload, dict):
        return None
    err = payload.get("error")
    if isinstance(err, dict):
        if isinstance(err.get("message"), str) and {"type", "param", "code"} <= err.keys():
            return None  # OpenAI's shape already
        message = err.get("message")
        return _error(status, message if isinstance(message, str) else msgspec.json.encode(err).decode(),
                      err.get("type"), err.get("param"), err.get("code"))
    if isinstance(err, str):
        return _error(status, err, payload.get("error_type") or payload.get("type"), None, payload.get("code"))
    if "message" in payload and (payload.get("object") == "error" or "type" in payload or "code" in payload):
        return _error(status, str(payload["message"]), payload.get("type"), payload.get("param"), payload.get("code"))
    if "detail" in payload:
        message, param = _fastapi_detail(payload["detail"])
        return _error(status, message, None, param)
    return None


def _text_of(data: bytes) -> str:
    """A plain-text or HTML answer as one readable line (an HTML page's title, else its text)."""
    head = data[:512].lstrip().lower()
    if head.startswith((b"<!doctype html", b"<html")) or b"<body" in head or b"<title" in head:
        title = _TITLE.search(data)
        text = title.group(1).decode("utf-8", "replace") if title else _TAGS.sub(" ", data.decode("utf-8", "replace"))
        return _SPACE.sub(" ", html.unescape(text)).strip()
    return data.decode("utf-8", "replace").strip()


def normalize_error_body(status: int, data: bytes) -> bytes:
    """A replica's non-2xx body as the bytes of an OpenAI error (its own bytes when already one)."""
    try:
        payload = _decode.decode(data)
    except msgspec.DecodeError:
        payload = None
    if isinstance(payload, dict):
        rewritten = error_payload(payload, status)
        if rewritten is not None:
            return _encode.encode(rewritten)
        err = payload.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return data
    return _encode.encode(_error(status, _text_of(data) if payload is None else data.decode("utf-8", "replace")))
