"""Validation of completion and chat request bodies.

The body is parsed to be checked and read (model, prompt or messages, stream flags, user,
cache_salt), but what goes upstream is the client's original JSON: its bytes untouched when the
router adds nothing, else the original dict plus only the router's additions.  The models below
therefore check the fields the router reads or whose wrong type would only fail later on the
replica; every other field passes through unvalidated (``extra="allow"``).

Bad input is a 400 in OpenAI's error shape, with ``param`` naming the offending field, as vLLM and
OpenAI answer it (422 would make the SDK raise a different exception class for the same mistake).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec
import numpy as np
from pydantic import BaseModel, ConfigDict, Field, Strict, StrictBool, StrictStr, ValidationError

from kvroute.common.errors import ApiError

# Token ids are hashed as uint32: anything outside that range is a client error, not a crash.
TokenId = Annotated[int, Strict(), Field(ge=0, lt=2**32)]
Number = Annotated[float, Strict()]  # strict float still accepts ints, never strings
PositiveInt = Annotated[int, Strict(), Field(ge=1)]
NonNegativeInt = Annotated[int, Strict(), Field(ge=0)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: StrictBool | None = None
    continuous_usage_stats: StrictBool | None = None


class _CommonRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: Annotated[StrictStr, Field(min_length=1)]
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    cache_salt: StrictStr | None = None
    max_tokens: NonNegativeInt | None = None
    max_completion_tokens: NonNegativeInt | None = None
    n: PositiveInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None


class CompletionRequest(_CommonRequest):
    prompt: (
        Annotated[StrictStr, Field(min_length=1)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[StrictStr], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    )


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: StrictStr
    text: StrictStr | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Annotated[StrictStr, Field(min_length=1)]
    content: StrictStr | list[ContentPart] | None = None


class ChatRequest(_CommonRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]


class PlainChatRequest(_CommonRequest):
    """A chat whose messages ``_plain_messages`` accepted: pydantic checks only the other fields.

    Building a model per message is most of the validation cost of a long conversation, and
    nearly every chat is plain text; anything else goes through :class:`ChatRequest`, so the
    errors are its errors.
    """

    messages: list[Any]


def _plain_messages(messages: Any) -> bool:
    """True for a non-empty list of objects with a non-empty string role and string or null
    content: what :class:`ChatMessage` accepts, checked without building models."""
    if type(messages) is not list or not messages:
        return False
    for message in messages:
        if type(message) is not dict:
            return False
        role, content = message.get("role"), message.get("content")
        if type(role) is not str or not role or (content is not None and type(content) is not str):
            return False
    return True


Kind = Literal["completion", "chat", "responses"]  # responses: common/responses.py
_MODELS: dict[Kind, type[_CommonRequest]] = {"completion": CompletionRequest, "chat": ChatRequest}
_decode = msgspec.json.Decoder()
_encode = msgspec.json.Encoder()


@dataclass
class ParsedRequest:
    kind: Kind
    raw: bytes  # the client's bytes, forwarded as they are when nothing is added
    body: dict[str, Any]  # the client's JSON, never mutated
    request: CompletionRequest | ChatRequest | PlainChatRequest

    @property
    def stream(self) -> bool:
        return bool(self.request.stream)

    @property
    def client_wants_usage(self) -> bool:
        opts = self.request.stream_options
        return bool(opts and opts.include_usage)

    @property
    def render_body(self) -> dict[str, Any]:
        """What routing renders and tokenizes (a Responses request: its chat, common/responses.py)."""
        return self.body

    def forward_body(self, additions: dict[str, Any]) -> bytes:
        """The bytes to send upstream: the original, plus only the router's additions."""
        if not additions:
            return self.raw
        return _encode.encode({**self.body, **additions})


# Deepest JSON nesting accepted: real requests nest a few levels; msgspec itself would recurse
# until Python's limit (a RecursionError, a 500) and every later walk of the body would too.
MAX_JSON_DEPTH = 128
_NOT_MARKS = bytes(b for b in range(256) if b not in b'"[]{}')


def json_depth_exceeds(raw: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """True if ``raw`` nests arrays/objects deeper than ``limit`` (brackets inside strings do not count).

    C and numpy speed whatever the body (~30 ms for 10 MB of brackets): a body with at most
    ``limit`` opening brackets cannot be deeper (one vector count); otherwise escapes are dropped (a
    run of backslashes pairs up from the left, so removing ``\\\\`` then ``\\"`` leaves only the
    quotes that open and close strings), everything but quotes and brackets is dropped
    (``bytes.translate``), and the brackets outside strings (an even number of quotes before them)
    are summed +1/-1."""
    if len(raw) <= limit:
        return False
    marks = np.frombuffer(raw, dtype=np.uint8)
    # '[' 0x5B | 0x20 == '{' 0x7B: one vector pass counts both (two bytes.count cost 2.5x as much)
    if np.count_nonzero((marks | 0x20) == 0x7B) <= limit:
        return False
    text = raw.replace(b"\\\\", b"").replace(b'\\"', b"") if b"\\" in raw else raw
    marks = np.frombuffer(text.translate(None, _NOT_MARKS), dtype=np.uint8)
    quote = marks == 0x22
    outside = (np.cumsum(quote, dtype=np.int32) & 1) == 0
    brackets = marks[outside & ~quote]
    # '[' 0x5B and '{' 0x7B have bit 1 set, ']' 0x5D and '}' 0x7D do not: +1 / -1
    steps = (brackets & 2).view(np.int8) - 1
    return bool(steps.size) and int(np.cumsum(steps, dtype=np.int32).max()) > limit


class _Message(msgspec.Struct):
    role: Any = None


class _ChatShape(msgspec.Struct):
    model: Any = None
    messages: list[_Message] | None = None
    chat_template: Any = None


_decode_shape = msgspec.json.Decoder(_ChatShape)


def chat_roles(raw: bytes) -> tuple[Any, list[Any]] | None:
    """A chat body's model and its messages' roles, read without building its messages' dicts
    (what a full parse costs, less the contents); None when the body is not a chat rendered with
    the model's own template (not shaped like one, or bringing its own ``chat_template``): its
    full parse then says why."""
    try:
        shape = _decode_shape.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None
    if shape.messages is None or shape.chat_template is not None:
        return None
    return shape.model, [m.role for m in shape.messages]


def decode_json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or a 400."""
    if not raw:
        raise ApiError(400, "request body is empty: a JSON object is required", code="invalid_json")
    if json_depth_exceeds(raw):
        raise ApiError(400, f"request body nests JSON deeper than {MAX_JSON_DEPTH} levels", code="invalid_json")
    try:
        body = _decode.decode(raw)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_json")
    return body


# what a union-typed field accepts, for a readable message (pydantic reports each member's failure)
_UNION_HINTS = {
    "prompt": "a non-empty string, list of token ids (0 <= id < 2**32), list of strings or list of token-id lists",
    "content": "a string, a list of content parts or null",
}


def _is_union_tag(part: str) -> bool:
    return any(c in part for c in "[]-")


def _body_path(body: Any, loc: tuple) -> tuple[list[str], bool]:
    """The error's location as a path in the body; True if pydantic named union members in it."""
    path: list[str] = []
    in_union = False
    node = body
    for part in loc:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            node = node[part]
        elif isinstance(node, dict) and isinstance(part, str) and not _is_union_tag(part):
            node = None  # a missing key: still part of the path
        else:
            in_union = True  # a union member's name (e.g. 'constrained-str'), not a body key
            continue
        path.append(str(part))
    return path, in_union


def validation_error(exc: ValidationError, body: Any) -> ApiError:
    """The first problem pydantic found, as the OpenAI error clients expect."""
    err = exc.errors(include_url=False)[0]
    path, in_union = _body_path(body, err["loc"])
    param = ".".join(path) or None
    if err["type"] == "missing":
        return ApiError(400, f"missing required parameter: {param!r}", param=param, code="missing_required_parameter")
    hint = _UNION_HINTS.get(path[-1]) if in_union and path else None
    detail = f"expected {hint}" if hint else err["msg"]
    return ApiError(400, f"invalid value for {param!r}: {detail}", param=param, code="invalid_type")


def parse_request(kind: Kind, raw: bytes) -> ParsedRequest:
    body = decode_json_object(raw)
    model = PlainChatRequest if kind == "chat" and _plain_messages(body.get("messages")) else _MODELS[kind]
    try:
        request = model.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc, body) from None
    return ParsedRequest(kind=kind, raw=raw, body=body, request=request)  # type: ignore[arg-type]


def prompt_batch(prompt: str | list) -> list[str | list[int]]:
    """A completion prompt as a list of prompts (vLLM treats a list of them as a batch)."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)
