"""The OpenAI Responses API (``POST /v1/responses``), routed as a chat (docs/design.md §1).

vLLM serves ``/v1/responses`` itself by turning the request into chat messages and rendering them
with the model's chat template, as for ``/v1/chat/completions``; the router renders the same
messages, so a Responses conversation hashes to the token prefix the engine caches:

- ``instructions`` -> a system message first;
- with ``previous_response_id``: the messages vLLM stored for that response (its own request's
  messages, built by these rules), then that response's output texts, one assistant message each;
- ``input``: a string -> one user message; a list -> its message items as they are (text parts of
  type ``input_text``/``output_text`` render as text, joined as chat content parts are).

Note that a turn's ``instructions`` come before the stored history, as vLLM composes them, so a
conversation repeating its instructions every turn changes its first block each turn (the engine
then reuses nothing across turns; the router predicts exactly that).

Items other than messages (function calls, their outputs, reasoning) are not rendered: the router
passes them to the replica but does not hash them.  What the router remembers of each response it
relayed, and how ``previous_response_id`` is routed, is router/request/response_memory.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, ValidationError

from kvroute.common.errors import ApiError
from kvroute.common.requests import NonNegativeInt, Number, ParsedRequest, decode_json_object, validation_error

NonEmptyStr = Annotated[StrictStr, Field(min_length=1)]


class InputItem(BaseModel):
    """An item of ``input``: a message (role + content) is checked; other item types pass."""

    model_config = ConfigDict(extra="allow")
    type: StrictStr | None = None
    role: NonEmptyStr | None = None
    content: StrictStr | list[dict[str, Any]] | None = None


class _InputItems(BaseModel):
    """``input`` as a list, checked on its own: its errors then name the item (``input.2.content``)."""

    input: list[InputItem]


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: NonEmptyStr
    input: NonEmptyStr | Annotated[list[Any], Field(min_length=1)]  # items: checked by _InputItems
    instructions: StrictStr | None = None
    previous_response_id: NonEmptyStr | None = None
    stream: StrictBool | None = False
    store: StrictBool | None = None
    user: StrictStr | None = None
    cache_salt: StrictStr | None = None
    max_output_tokens: NonNegativeInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None


@dataclass
class ResponsesParsed(ParsedRequest):
    """A Responses request; ``render`` is the chat routing renders (see :func:`chat_messages`)."""

    render: dict[str, Any] = field(default_factory=dict)

    @property
    def render_body(self) -> dict[str, Any]:
        return self.render

    @property
    def client_wants_usage(self) -> bool:
        return True  # usage always arrives in response.completed: nothing to ask for, nothing to withhold


def _is_message(item: dict[str, Any]) -> bool:
    return item.get("type") in (None, "message") and isinstance(item.get("role"), str)


def parse_responses(raw: bytes) -> ResponsesParsed:
    """The body checked (400 in OpenAI's shape naming the field); ``render`` is filled by
    :meth:`ResponseMemory.prepare`."""
    body = decode_json_object(raw)
    try:
        request = ResponsesRequest.model_validate(body)
        if isinstance(body["input"], list):
            _InputItems.model_validate({"input": body["input"]})
    except ValidationError as exc:
        raise validation_error(exc, body) from None
    if isinstance(body["input"], list):
        for i, item in enumerate(body["input"]):
            if item.get("type") in (None, "message") and item.get("role") is None:
                raise ApiError(400, f"missing required parameter: 'input.{i}.role'", param=f"input.{i}.role",
                               code="missing_required_parameter")
    return ResponsesParsed(kind="responses", raw=raw, body=body, request=request)  # type: ignore[arg-type]


def input_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The request's own messages (``input`` as chat messages; non-message items are left out)."""
    value = body["input"]
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    return [item for item in value if _is_message(item)]


def chat_messages(instructions: str | None, history: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict]:
    """The chat vLLM renders for a Responses request: instructions, the stored history, the input."""
    head = [{"role": "system", "content": instructions}] if instructions else []
    return head + history + new


def output_texts(response: dict[str, Any]) -> list[str]:
    """A response's output message texts, in order (what vLLM replays as assistant messages)."""
    texts = []
    for item in response.get("output") or ():
        if isinstance(item, dict) and item.get("type") == "message":
            for part in item.get("content") or ():
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    texts.append(part["text"])
    return texts
