"""Request validation: what the router accepts, what it rejects (400 with the field named), and
that the body goes upstream unchanged except for the router's own additions."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.common.errors import ApiError
from kvroute.common.requests import json_depth_exceeds, parse_request, prompt_batch


def _err(kind: str, body: bytes) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_request(kind, body)  # type: ignore[arg-type]
    return info.value


@pytest.mark.parametrize(
    "prompt, batch",
    [("hello", ["hello"]), ([1, 2, 3], [[1, 2, 3]]), (["a", "b"], ["a", "b"]), ([[1, 2], [3]], [[1, 2], [3]])],
)
def test_completion_prompt_shapes_accepted(prompt, batch):
    parsed = parse_request("completion", json.dumps({"model": "m", "prompt": prompt}).encode())
    assert parsed.request.prompt == prompt
    assert prompt_batch(parsed.request.prompt) == batch


@pytest.mark.parametrize(
    "body, param, code",
    [
        ({"prompt": "x"}, "model", "missing_required_parameter"),
        ({"model": 3, "prompt": "x"}, "model", "invalid_type"),
        ({"model": "", "prompt": "x"}, "model", "invalid_type"),
        ({"model": "m"}, "prompt", "missing_required_parameter"),
        ({"model": "m", "prompt": 5}, "prompt", "invalid_type"),
        ({"model": "m", "prompt": []}, "prompt", "invalid_type"),
        ({"model": "m", "prompt": [1, -1]}, "prompt", "invalid_type"),
        ({"model": "m", "prompt": [1, 2**32]}, "prompt", "invalid_type"),
        ({"model": "m", "prompt": [[1], "a"]}, "prompt", "invalid_type"),
        ({"model": "m", "prompt": "x", "stream": "yes"}, "stream", "invalid_type"),
        ({"model": "m", "prompt": "x", "max_tokens": "5"}, "max_tokens", "invalid_type"),
        ({"model": "m", "prompt": "x", "temperature": "hot"}, "temperature", "invalid_type"),
        ({"model": "m", "prompt": "x", "stream_options": {"include_usage": 1}}, "stream_options.include_usage", "invalid_type"),
        ({"model": "m", "prompt": "x", "cache_salt": 7}, "cache_salt", "invalid_type"),
    ],
)
def test_completion_rejections_name_the_field(body, param, code):
    err = _err("completion", json.dumps(body).encode())
    assert (err.status, err.param, err.code) == (400, param, code)


@pytest.mark.parametrize(
    "body, param, code",
    [
        ({"model": "m"}, "messages", "missing_required_parameter"),
        ({"model": "m", "messages": "hi"}, "messages", "invalid_type"),
        ({"model": "m", "messages": []}, "messages", "invalid_type"),
        ({"model": "m", "messages": [{"content": "hi"}]}, "messages.0.role", "missing_required_parameter"),
        ({"model": "m", "messages": [{"role": 1, "content": "hi"}]}, "messages.0.role", "invalid_type"),
        ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages.0.content", "invalid_type"),
        (
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
            "messages.0.content",
            "invalid_type",
        ),
    ],
)
def test_chat_rejections_name_the_field(body, param, code):
    err = _err("chat", json.dumps(body).encode())
    assert (err.status, err.param, err.code) == (400, param, code)


@pytest.mark.parametrize("raw", [b"", b"{bad", b"[1, 2]", b'"text"', b"\xff\xfe", b"null"])
def test_malformed_json_is_400_invalid_json(raw):
    err = _err("chat", raw)
    assert (err.status, err.code) == (400, "invalid_json")


def test_chat_accepts_parts_tools_and_unknown_fields():
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]},
            {"role": "tool", "content": "42", "tool_call_id": "c1"},
        ],
        "some_vendor_field": {"x": [1, 2]},
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    parsed = parse_request("chat", json.dumps(body).encode())
    assert parsed.stream and parsed.client_wants_usage


def test_body_forwarded_byte_for_byte_without_additions():
    raw = b'{"model": "m",   "prompt": "x", "zzz_unknown": [1, {"a": null}], "temperature": 0.5}'
    parsed = parse_request("completion", raw)
    assert parsed.forward_body({}) is raw


def test_additions_keep_every_client_field():
    body = {"model": "m", "prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": False}, "odd": [1]}
    parsed = parse_request("completion", json.dumps(body).encode())
    out = msgspec.json.decode(parsed.forward_body({"stream_options": {"continuous_usage_stats": False, "include_usage": True}}))
    assert out == {**body, "stream_options": {"continuous_usage_stats": False, "include_usage": True}}
    assert parsed.body == body  # the parsed original is never mutated


def _depth(value) -> int:
    if isinstance(value, (list, dict)):
        return 1 + max(map(_depth, value.values() if isinstance(value, dict) else value), default=0)
    return 0


_TRICKY = st.text(alphabet='ab"\\[]{}/\u00e9\n', max_size=8)  # quotes, backslashes, brackets inside strings
_JSON = st.recursive(
    st.none() | st.integers() | _TRICKY,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TRICKY, inner, max_size=3),
    max_leaves=20,
)


@settings(max_examples=400, deadline=None)
@given(value=_JSON, ascii_only=st.booleans())
def test_json_depth_pre_scan_matches_the_parsed_depth(value, ascii_only):
    raw = json.dumps(value, ensure_ascii=ascii_only).encode()
    for limit in range(0, 7):
        assert json_depth_exceeds(raw, limit) == (_depth(value) > limit), (limit, raw)
